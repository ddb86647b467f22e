"""The one-call decode step (slimkv.backends.cpu_step) against the per-op path it replaces: the
same greedy tokens and bit-identical logits at every step, for one and several sequences,
across block boundaries (filled blocks go to the pool), staged (int8) and unstaged KV (`auto`:
the model dtype, bfloat16 or float32 by CPU; a pool in another float dtype takes the per-op
path), with both activation modes; and int4 KV with kv_cache.int4's rotations of K and V
(decode_step.c's hadamard_rows, called by both paths)."""

from __future__ import annotations

import pytest
import torch

from slimkv.bench.compare import engine_for, greedy
from slimkv.config import Config
from slimkv.kernels.qgemm import qgemm_native
from slimkv.model.lean import set_activations
from slimkv.workload import random_prompt

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not qgemm_native(), reason="quantized weights need the "
                                 "native weight kernel (model.weights auto keeps floats)")]


def _run(engine, one_call: bool, num_seqs: int, new_tokens: int):
    """Greedy tokens of ``num_seqs`` prompts (13.. tokens: blocks fill while decoding), every
    step's logits, and how many steps ran in one call."""
    runner = engine.runner
    runner.lean_step.enabled = one_call
    logits, calls = [], [0]
    compute, call = runner.model.compute_logits, runner.lean_step._call

    def counted(*args):
        calls[0] += 1
        return call(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner.model, "compute_logits", lambda h: logits.append(compute(h)) or logits[-1])
        mp.setattr(runner.lean_step, "_call", counted)
        seqs = [engine.add_request(random_prompt(13 + 2 * i, engine.model_args.vocab_size,
                                                 seed=40 + i), greedy(new_tokens))
                for i in range(num_seqs)]
        while engine.has_unfinished():
            engine.step()
    return [s.token_ids for s in seqs], logits, calls[0]


@pytest.fixture(scope="module", params=["int8", "auto", "int4-rotated"])
def engine(request):
    if request.param == "int4-rotated":
        config = Config.load().replace("kv_cache", int4={"rotate_k": True, "rotate_v": True})
        engine = engine_for(config, "int4", 6, 128)
        assert engine.runner.attention.rotate == [(True, True)] * engine.model_args.num_layers
        return engine
    return engine_for(Config.load(), request.param, 6, 128)


@pytest.mark.parametrize("num_seqs", [1, 2, 5])
def test_one_call_step_equals_the_per_op_path(engine, num_seqs: int) -> None:
    tokens, logits, _ = _run(engine, False, num_seqs, 24)
    tokens_c, logits_c, calls = _run(engine, True, num_seqs, 24)
    assert tokens_c == tokens
    assert len(logits_c) == len(logits)
    for step, (a, b) in enumerate(zip(logits, logits_c)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max()}"
    assert calls >= 23  # int8 KV is staged, model-dtype KV is not: the step takes both


def test_precise_activations_too(engine) -> None:
    model = engine.runner.model
    set_activations(model, True)
    try:
        tokens, logits, _ = _run(engine, False, 2, 20)
        tokens_c, logits_c, _ = _run(engine, True, 2, 20)
    finally:
        set_activations(model, engine.runner.config.model.activations == "precise")
    assert tokens_c == tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, logits_c, strict=True))


def test_biases_too(engine) -> None:
    """Qwen2 has QKV biases; the step adds any projection's bias as the per-op path does."""
    linears = [lin for block in engine.runner.model.layers for lin in block.parts[:4]]
    for i, lin in enumerate(linears):
        lin.bias = torch.nn.Parameter(0.05 * torch.randn(lin.out_features,
                                                         generator=torch.Generator().manual_seed(i)),
                                      requires_grad=False)
    engine.runner.lean_step.reset()
    try:
        tokens, logits, _ = _run(engine, False, 2, 20)
        tokens_c, logits_c, calls = _run(engine, True, 2, 20)
    finally:
        for lin in linears:
            lin.bias = None
        engine.runner.lean_step.reset()
    assert calls >= 19 and tokens_c == tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, logits_c, strict=True))
