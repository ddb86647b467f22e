"""The engine with weights in the GGUF's own class (int4 Q4_1 layers, int8 Q8_0 embedding
and LM head) against the same engine on the dequantized float32 weights: perplexity on the
eval corpus and greedy chat output. Both run float32 activations and float32 KV, so the
only difference is the weight kernel's activation rounding (model.activations: precise =
int8 + int8 residual per group of 32 by default, int8 as an option)."""

from __future__ import annotations

import pytest
import torch

import slimkv.model_io.loader
from slimkv.config import Config, ConfigError
from slimkv.eval.corpus import windows
from slimkv.kernels.qgemm import qgemm_kernel, qgemm_unavailable_reason
from slimkv.llm import LLM
from slimkv.model.lean import set_activations
from slimkv.model_io.weights import resolve_weights
from slimkv.engine.sampling import SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(qgemm_kernel() is None,
                                 reason=f"no weight kernel: {qgemm_unavailable_reason()}")]
CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Explain photosynthesis in one sentence.", "List three prime numbers."]
# A flipped near-tie is not a wrong token: the float engine's logit margin between its own
# pick and the int4 engine's pick at the first divergence must be below this.
TIE_MARGIN = 0.5


def _llm(weights: str) -> LLM:
    config = Config().replace("model", dtype="float32", weights=weights)
    return LLM(config.replace("kv_cache", dtype="float32", num_blocks=512))


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    """The file's classes with float32 activations (``auto`` would pick them with
    model.dtype auto, i.e. bf16 here), and the dequantized float32 engine."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slimkv.model_io.loader, "resolve_weights", lambda *args: "file")
        quant = _llm("auto")
    return quant, _llm("float32")


def test_file_classes_are_kept(engines) -> None:
    quant, ref = engines
    split_q, split_f = quant.engine.runner.memory_split(), ref.engine.runner.memory_split()
    assert split_q["weights"] < split_f["weights"] / 4       # ~0.63-1.06 bytes vs 4 per weight
    model = quant.engine.runner.model
    assert model.lm_head.bits == 8                           # Q8_0 tied embedding
    assert {layer.attention.wqkv.bits for layer in model.layers} == {4}  # Q4_1


def test_int4_and_int8_classes_quantize_everything() -> None:
    for weights, bits in (("int4", 4), ("int8", 8)):
        model = _llm(weights).engine.runner.model
        assert model.lm_head.bits == bits
        assert {layer.feed_forward.w2.bits for layer in model.layers} == {bits}


def test_auto_picks_the_file_class_only_with_a_native_kernel_and_unpinned_dtype() -> None:
    cpu = torch.device("cpu")
    native = qgemm_kernel().native
    assert resolve_weights("auto", "auto", cpu) == ("file" if native else "float")
    assert resolve_weights("auto", "float32", cpu) == "float"
    assert resolve_weights("auto", "auto", torch.device("meta")) == "float"
    with pytest.raises(ConfigError, match="CPU weight kernel"):
        resolve_weights("int4", "auto", torch.device("meta"))


def _perplexity(llm: LLM, windows_: list[list[int]], chunk: int) -> float:
    nll, count = 0.0, 0
    for ids in windows_:
        logprobs = llm.engine.score(ids, chunk=chunk)[:-1].float().log_softmax(-1)
        targets = torch.tensor(ids[1:])
        nll -= logprobs.gather(-1, targets[:, None]).sum().item()
        count += len(targets)
    return float(torch.exp(torch.tensor(nll / count)))


def _perplexity_delta(quant: LLM, ref: LLM) -> float:
    """int4 scored one token per step (the decode kernel's path) vs the dequantized engine."""
    text = windows(ref.tokenizer, 256, 2)
    ppl_q, ppl_f = _perplexity(quant, text, chunk=1), _perplexity(ref, text, chunk=512)
    print(f"perplexity int4 {ppl_q:.4f} float32 {ppl_f:.4f} ({ppl_q / ppl_f - 1:+.4%})")
    return abs(ppl_q / ppl_f - 1)


def test_perplexity_within_a_tenth_of_a_percent_on_the_decode_path(engines) -> None:
    """The default ``model.activations: precise`` (int8 + int8 residual, ~15 bits)."""
    assert _perplexity_delta(*engines) <= 0.001


def test_int8_activations_option_is_coarser_but_bounded(engines) -> None:
    """``model.activations: int8`` (one int8 row per group of 32, llama.cpp's Q8_1): its
    rounding shows in perplexity (more than PRECISE's), but stays a rounding: within 2%."""
    quant, ref = engines
    precise = _perplexity_delta(quant, ref)
    set_activations(quant.engine.runner.model, False)
    try:
        coarse = _perplexity_delta(quant, ref)
    finally:
        set_activations(quant.engine.runner.model, True)
    assert precise < coarse <= 0.02


def test_greedy_chat_equals_the_dequantized_engine(engines) -> None:
    quant, ref = engines
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for chat in CHATS:
        conv = [{"role": "user", "content": chat}]
        [q], [f] = quant.chat(conv, params), ref.chat(conv, params)
        if q.token_ids == f.token_ids:
            continue
        j = next(i for i, (a, b) in enumerate(zip(q.token_ids, f.token_ids)) if a != b)
        prompt = ref.tokenizer.apply_chat_template(conv) + f.token_ids[:j]
        logits = ref.engine.score(prompt)[-1]
        margin = float(logits[f.token_ids[j]] - logits[q.token_ids[j]])
        print(f"{chat!r}: first divergence at token {j}, float margin {margin:.4f}")
        assert margin < TIE_MARGIN, (chat, j, margin)
