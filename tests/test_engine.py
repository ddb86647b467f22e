"""The engine end to end on the embedded model: exactness against transformers, batching,
chunked prefill, sampling, stops, preemption, prefix caching and the pool's accounting."""

import pytest
import torch

from slimkv.config import Config
from slimkv.engine.llm_engine import RequestError
from slimkv.engine.runner import resolve_dtype
from slimkv.llm import LLM
from slimkv.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]


def make_llm(scheduler=None, model=None, **kv) -> LLM:
    config = Config().replace("kv_cache", **{"dtype": "float32", **kv}).replace(
        "model", dtype="float32")
    if scheduler:
        config = config.replace("scheduler", **scheduler)
    if model:
        config = config.replace("model", **model)
    return LLM(config)


def long_text(llm: LLM, n_tokens: int, seed: int) -> list[int]:
    words = ["river", "stone", "market", "winter", "lamp", "garden", "letter", "harbour",
             "engine", "orchard", "bridge", "candle", "meadow", "violin", "ladder", "copper"]
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(words), (n_tokens,), generator=gen).tolist()
    return llm.tokenizer.encode(" ".join(words[i] for i in picks))[:n_tokens]


def assert_pool_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.pool.blocks)


@pytest.fixture(scope="module")
def llm32():
    return make_llm()


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:        # generate all n tokens, like ignore_eos (the session's model, restored)
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = eos
    return out[0, len(ids):].tolist()


def test_greedy_matches_transformers_for_32_tokens(llm32, hf_reference):
    chats = [[{"role": "user", "content": "What is the capital of France?"}]]
    prompts = [llm32.tokenizer.encode(p) for p in PROMPTS] + [
        llm32.tokenizer.apply_chat_template(c) for c in chats]
    results = llm32.generate(prompts, GREEDY)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(hf_reference, prompt, 32)
    assert_pool_idle(llm32)


def test_chat_answers_paris_with_int8_kv():
    llm = make_llm(dtype="int8")
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in out.text and out.finish_reason == "stop"


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_batch_equals_each_prompt_alone_with_small_chunks(llm32, dtype):
    llm = make_llm(dtype=dtype, scheduler={"max_num_batched_tokens": 64})
    prompts = [long_text(llm, n, seed=n) for n in (7, 90, 250)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    batched = [r.token_ids for r in llm.generate(prompts, params)]
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    assert batched == alone
    assert_pool_idle(llm)


def test_seeded_sampling_is_reproducible_across_batches(llm32):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    a = llm32.generate(PROMPTS[1], params)[0].token_ids
    b = llm32.generate([PROMPTS[0], PROMPTS[1]], [GREEDY, params])[1].token_ids
    assert a == b
    c = llm32.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.9, seed=99))[0]
    assert c.token_ids != a


def test_stop_strings_stop_tokens_and_length(llm32):
    free = llm32.generate(PROMPTS[1], GREEDY)[0]
    stop_word = free.text.split()[2]
    stopped = llm32.generate(PROMPTS[1], SamplingParams(max_tokens=32, temperature=0,
                                                        stop=[stop_word]))[0]
    assert stopped.finish_reason == "stop" and stop_word not in stopped.text
    assert free.text.startswith(stopped.text)
    tok = free.token_ids[5]
    by_id = llm32.generate(PROMPTS[1], SamplingParams(max_tokens=32, temperature=0,
                                                      stop_token_ids=[tok]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids[-1] == tok
    assert len(by_id.token_ids) == free.token_ids.index(tok) + 1
    short = llm32.generate(PROMPTS[1], SamplingParams(max_tokens=3, temperature=0))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    assert_pool_idle(llm32)


def test_bad_requests_are_refused_without_leaking(llm32):
    engine = llm32.engine
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(RequestError, match="maximum context length"):
        engine.add_request([1] * engine.max_model_len, GREEDY)
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request([10 ** 9], GREEDY)
    assert_pool_idle(llm32)


def test_abort_returns_blocks(llm32):
    engine = llm32.engine
    seq = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    assert seq.blocks and engine.pool.num_free_blocks < engine.pool.num_blocks
    engine.abort_request(seq.request_id)
    assert seq.finish_reason == "abort"
    assert_pool_idle(llm32)


def test_preemption_completes_with_the_same_greedy_output(llm32):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [long_text(llm32, 40, seed=s) for s in range(4)]
    expected = [r.token_ids for r in llm32.generate(prompts, params)]
    tight = make_llm(num_blocks=12)   # 4 x ceil(64 / 16) = 16 blocks would be needed at once
    got = [r.token_ids for r in tight.generate(prompts, params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert_pool_idle(tight)


def test_multi_turn_chat_prefills_only_the_new_turn(llm32):
    engine = llm32.engine
    turn1 = [{"role": "user", "content": "Tell me a short fact about the moon."}]
    first = llm32.chat(turn1, SamplingParams(max_tokens=24, temperature=0))[0]
    turn2 = turn1 + [{"role": "assistant", "content": first.text},
                     {"role": "user", "content": "And one about the sun?"}]
    prompt2 = llm32.tokenizer.apply_chat_template(turn2)
    hits_before = engine.manager.num_prefix_hits
    second = llm32.generate(prompt2, SamplingParams(max_tokens=4, temperature=0))[0]
    shared = len(first.prompt_token_ids)   # turn 1's prompt is a prefix of turn 2's
    assert prompt2[:shared] == first.prompt_token_ids
    assert second.num_cached_tokens >= shared // 16 * 16
    assert engine.manager.num_prefix_hits - hits_before == second.num_cached_tokens


def _session_survives(evict_policy: str) -> tuple[int, int]:
    """A long session's document, then other traffic through a small pool, then turn 2."""
    llm = make_llm(num_blocks=40, evict_policy=evict_policy)
    engine = llm.engine
    doc = long_text(llm, 320, seed=7)                      # 20 blocks at the head
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    seq = engine.add_request(doc, params, session_id="s1")
    while engine.has_unfinished():
        engine.step()
    for i in range(6):                                     # 6 x 8 blocks of other traffic
        llm.generate(long_text(llm, 128, seed=100 + i), params)
    turn2 = seq.token_ids + long_text(llm, 20, seed=999)
    out = llm.generate(turn2, params)[0]
    return out.num_cached_tokens, engine.pool.num_evictions


def test_fifo_evicts_a_live_sessions_head_and_lru_block_keeps_it():
    fifo_cached, fifo_evictions = _session_survives("fifo")
    lru_cached, lru_evictions = _session_survives("lru_block")
    assert fifo_evictions > 0 and lru_evictions > 0        # both pools were under pressure
    assert fifo_cached == 0                                # re-prefills the whole document
    assert lru_cached >= 320                               # only the new turn is prefilled


def test_paged_admits_what_contiguous_refuses_in_the_same_memory():
    prompts_lens = [40, 300, 60, 200, 80, 120, 30, 150]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def run(paged: bool):
        llm = make_llm(num_blocks=128, paged=paged, enable_prefix_caching=False,
                       model={"max_model_len": 1024})
        engine = llm.engine
        for i, n in enumerate(prompts_lens):
            engine.add_request(long_text(llm, n, seed=i), params)
        peak = 0
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, engine.scheduler.num_running())
        assert_pool_idle(llm)
        return peak, getattr(engine.manager, "num_false_oom", 0)

    paged_peak, paged_false_oom = run(True)
    contiguous_peak, contiguous_false_oom = run(False)
    print(f"peak running paged={paged_peak} contiguous={contiguous_peak}; "
          f"false OOM paged={paged_false_oom} contiguous={contiguous_false_oom}")
    assert paged_peak == len(prompts_lens) and paged_false_oom == 0
    assert contiguous_peak == 2 and contiguous_false_oom > 0


def test_auto_model_dtype_is_bfloat16_only_where_native(monkeypatch: pytest.MonkeyPatch) -> None:
    import slimkv.engine.runner as runner_module

    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) == torch.float32
    monkeypatch.setattr(runner_module, "_cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(runner_module, "_cpu_flags", lambda: {"avx2", "fma"})
    assert resolve_dtype("auto", cpu) == torch.float32
