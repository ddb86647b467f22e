"""The engine with its attention on the Triton kernels (prefill, decode, pool writes), run on the
CPU by Triton's interpreter (conftest sets TRITON_INTERPRET=1 where there is no CUDA):
the same greedy tokens as the engine on the C kernels, the same pool bytes, and the Triton
decode taken in every layer. This is the glue's test; the kernels' own tests are
tests/test_triton_kernels.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from slimkv.attention.layer import PagedAttention
from slimkv.backends import KERNELS
from slimkv.config import Config
from slimkv.engine.sampling_params import SamplingParams
from slimkv.plugins import build_engine
from slimkv.workload import run_until_done
from test_cuda import write_checkpoint

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or
                                torch.cuda.is_available(),
                                reason="runs the Triton kernels under the CPU interpreter")
# Prompts of 21-40 tokens and 12 new ones: decodes cross a block edge (a staged block fills).
PROMPTS = ["the quick brown fox jumps over the lazy dog " * 3, "over the lazy dog " * 4,
           "quick brown " * 6]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


def serve(path: Path, kv_dtype: str, k_scale: str, triton: bool):
    config = Config.from_dict({"model": {"path": str(path), "device": "cpu", "dtype": "float32"},
                               "kv_cache": {"dtype": kv_dtype, "k_scale": k_scale,
                                            "memory_gb": 0.02}})
    engine = build_engine(config)
    runner = engine.runner
    if triton:  # what the runner builds on CUDA, here on CPU tensors
        runner.attention = PagedAttention(runner.cache, runner.model_args.num_heads,
                                          runner.model_args.head_dim ** -0.5, runner.dtype,
                                          staging=runner.staging, backend="triton", kernels=KERNELS)
        runner.lean_step = None
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in PROMPTS]
    run_until_done(engine)
    return [s.output_token_ids for s in seqs], engine


# A float pool, a per-token-scaled one, and the default staged layout (per-channel-block keys);
# the kernels' tests cover every format, this the engine's use of them.
@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype, k_scale", [
    ("bfloat16", "per_token"), ("fp8_e4m3", "per_token"), ("int8", "per_channel_block")])
def test_the_triton_engine_equals_the_c_engine(checkpoint: Path, kv_dtype: str,
                                               k_scale: str) -> None:
    tokens, engine = serve(checkpoint, kv_dtype, k_scale, triton=True)
    expected, reference = serve(checkpoint, kv_dtype, k_scale, triton=False)
    assert tokens == expected
    attention = engine.runner.attention
    assert attention.decode_path == "triton_decode" and engine.runner.cache.writer is not None
    for layer in range(engine.runner.cache.num_layers):
        counts = attention.layer_path_counts[layer]
        assert counts["triton_decode"] > 0 and counts["triton_prefill"] > 0, (layer, counts)
    # The Triton writes store the codecs' codes and scales bit for bit. Layer 0 only: its
    # K/V come from the same embeddings in both engines, while deeper layers' inputs carry
    # the two decode kernels' float32 rounding (~1e-6) from the layer before.
    ours, theirs = engine.runner.cache.tensors(), reference.runner.cache.tensors()
    for name, t in theirs.items():
        assert torch.equal(ours[name][0].view(torch.uint8), t[0].view(torch.uint8)), name
