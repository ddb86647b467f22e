"""The OpenAI sampling options at the engine: logprobs against a float32 reference forward
(transformers), ``n`` sharing one prefill, ``min_tokens``, and structured output (every
generation parses and validates against its schema with ``jsonschema``)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from slimkv.config import Config
from slimkv.engine.llm_engine import RequestError
from slimkv.llm import LLM
from slimkv.options.structured import StructuredOutput, canonical_schema
from slimkv.engine.outputs import RequestOutput
from slimkv.engine.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(Config().replace("kv_cache", dtype="float32", num_blocks=512)
               .replace("model", dtype="float32"))


def grammars(llm: LLM):
    """The structured-output processor's grammars (slimkv.options)."""
    return next(p.grammars for p in llm.engine.runner.sampler.processors
                if isinstance(p, StructuredOutput))


def run(llm: LLM, prompt: str | list[int], params: SamplingParams) -> list[RequestOutput]:
    engine = llm.engine
    seq = engine.add_request(prompt, params)
    outs = []
    while engine.has_request(seq.parent_id):
        outs += [o for o in engine.step() if o.request_id == seq.parent_id]
    return outs


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_a_float32_reference_forward(llm, hf_reference, temperature):
    prompt = llm.tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=3, logprobs=5,
                            ignore_eos=True)
    outs = run(llm, prompt, params)
    output = [o.new_token_ids[0] for o in outs]
    with torch.inference_mode():
        ref = hf_reference(torch.tensor([prompt + output])).logits[0].float().log_softmax(-1)
    ref = ref[len(prompt) - 1:-1]
    for pos, (out, token) in enumerate(zip(outs, output)):
        (lp,) = out.logprobs
        assert lp.token == llm.tokenizer.token_texts([token])[0]
        assert lp.logprob == pytest.approx(ref[pos, token].item(), abs=2e-3)
        top_values, top_ids = ref[pos].topk(5)
        assert [t for t, _ in lp.top] == llm.tokenizer.token_texts(top_ids.tolist())
        assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=2e-3)


def test_n_choices_share_one_prefill(llm):
    engine = llm.engine
    prompt = llm.tokenizer.encode(" ".join(f"item {i}," for i in range(40))
                                  + " Now, a short story about a dragon:")  # > 6 blocks
    block = engine.config.kv_cache.block_size
    computed: list[int] = []
    execute = engine.runner.execute

    def counting(scheduled):
        computed.extend(n for _, n in scheduled)
        return execute(scheduled)

    engine.runner.execute = counting
    try:
        outs = run(llm, prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=4,
                                               ignore_eos=True))
    finally:
        engine.runner.execute = execute
    finals = {o.index: o for o in outs if o.finished}
    assert sorted(finals) == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 6 for o in finals.values())
    assert len({tuple(o.token_ids) for o in finals.values()}) > 1  # seed + i per choice
    # One prefill, plus each other choice's last (partial) block and the decodes.
    shared = (len(prompt) - 1) // block * block
    assert sum(computed) == len(prompt) + 3 * (len(prompt) - shared) + 4 * 5
    assert [finals[i].num_cached_tokens for i in (1, 2, 3)] == [shared] * 3
    assert not engine.requests and engine.pool.num_free_blocks == engine.pool.num_blocks


def test_min_tokens_holds_off_the_end(llm):
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    free = run(llm, prompt, SamplingParams(max_tokens=64, temperature=0))[-1]
    assert free.finish_reason == "stop" and free.num_output_tokens < 40
    least = free.num_output_tokens + 8
    held = run(llm, prompt, SamplingParams(max_tokens=64, temperature=0, min_tokens=least))[-1]
    assert held.num_output_tokens >= least
    assert held.token_ids[:free.num_output_tokens - 1] == free.token_ids[:-1]  # same until eos


def test_logit_bias_forces_a_token(llm):
    token = llm.tokenizer.encode(" banana")[-1]
    outs = run(llm, "Once upon a time", SamplingParams(max_tokens=5, temperature=0,
                                                       logit_bias={token: 100.0}))
    assert [o.new_token_ids[0] for o in outs] == [token] * 5


SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
               "properties": {"name": {"type": "string", "maxLength": 12},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "enum and boolean": {"type": "object", "additionalProperties": False,
                         "required": ["color", "ok"],
                         "properties": {"color": {"enum": ["red", "green", "blue"]},
                                        "ok": {"type": "boolean"}}},
}
# JSON mode ({"type": "json_object"}) bounds nothing: at temperature 1 this 135M model can
# wander off inside a string past max_tokens, so it is tested over HTTP at temperature 0
# (tests/test_server_options.py), not here.
ASK = {"person": "a person's name and age", "enum and boolean": "a color and a boolean"}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_fifty_structured_generations_validate(llm, name):
    schema = SCHEMAS[name]
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Reply with a short JSON object: {ASK[name]}."}])
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=s,
                             json_schema=canonical_schema(schema)) for s in range(50)]
    compiled = grammars(llm).num_compiled
    results = llm.generate([prompt] * 50, params)
    assert grammars(llm).num_compiled - compiled <= 1  # compiled once, cached
    for r in results:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), schema)


def test_an_invalid_schema_is_refused_before_queueing(llm):
    with pytest.raises(ValueError, match="invalid JSON schema"):
        llm.engine.add_request("Hi", SamplingParams(json_schema='{"type": "nonsense"}'))
    assert not llm.engine.requests


def test_an_engine_without_processors_refuses_the_options(llm, monkeypatch):
    """The core serves an option only through a logits processor it was given (built by
    slimkv.plugins.build_engine); without one the request is refused, not served plain."""
    monkeypatch.setattr(llm.engine.runner, "sampler", Sampler())
    for option in ({"logprobs": 0}, {"min_tokens": 2}, {"logit_bias": {5: 1.0}},
                   {"presence_penalty": 0.5}, {"json_schema": canonical_schema({})}):
        with pytest.raises(RequestError, match="no logits processor"):
            llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, **option))
    assert not llm.engine.has_unfinished()
