"""``slimkv verify``: prove the quantized attention path really runs, per KV dtype and layer.

For each KV dtype, an engine (``strict: false``, so a fallback is reported rather than
refused) serves a few prompts through prefill and batched decode. Every attention call is
checked against :func:`reference_paged_attention` over the same pool state, and per layer
we record the paths taken (on the CPU ``fast_prefill`` and ``fused_decode`` or
``fast_decode``, on CUDA ``triton_prefill`` and ``triton_decode``: the quantized fast path;
``reference`` = the fallback). A dtype fails on any fallback, any pool tensor whose storage
dtype is not the configured format's (a silent float fallback), or any mismatch.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from slimkv.attention.layer import PagedAttention
from slimkv.attention.metadata import AttentionMetadata
from slimkv.attention.reference import reference_paged_attention
from slimkv.config import Config
from slimkv.engine.llm_engine import LLMEngine
from slimkv.kv.quant import make_codec
from slimkv.plugins import build_engine
from slimkv.stats import cdiv

ALL_KV_DTYPES = ("float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "int4")
PREFILL_PATHS = {"cpu": ("fast_prefill",), "cuda": ("triton_prefill",)}
# The native C kernel, or gather + SDPA (CPU); on CUDA only the Triton kernel counts: the
# gathered path there is the float copy of the whole prefix the kernel exists to avoid.
DECODE_PATHS = {"cpu": ("fused_decode", "fast_decode"), "cuda": ("triton_decode",)}
# Fast and reference paths read the same quantized values; only float rounding differs.
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


class CheckedAttention:
    """Runs the engine's attention, then the reference on the same pool, and keeps the worst
    relative error per layer."""

    def __init__(self, attention: PagedAttention) -> None:
        self.attention = attention
        self.errors: defaultdict[int, float] = defaultdict(float)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        a, staged = self.attention, {}
        if meta.prefills:  # the reference needs the chunks' K/V the layer's write returns
            q, k, v = (x.to(a.dtype) for x in (q, k, v))
            staged = a.backend.write(layer, k, v, meta)
            out, paths = a.backend.attend(layer, q, meta, staged)
            a.count(layer, paths)
        else:
            out = a(layer, q, k, v, meta)
        # The backend takes q as rounded to a.dtype: the reference must too.
        ref = reference_paged_attention(a.cache, layer, q.to(a.dtype), meta, a.scale, a.dtype,
                                        a.staging, staged).float()
        error = ((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
        self.errors[layer] = max(self.errors[layer], error)
        return out


def verify_dtype(config: Config, kv_dtype: str, prompt_len: int = 40, new_tokens: int = 4) -> dict[str, Any]:
    """Serve two prompts through one engine for ``kv_dtype``; the per-layer report."""
    from slimkv.engine.sampling import SamplingParams
    from slimkv.workload import random_prompt, run_until_done

    blocks_per_prompt = cdiv(prompt_len + new_tokens, config.kv_cache.block_size)
    config = config.replace("kv_cache", dtype=kv_dtype, k_dtype=None, v_dtype=None,
                            layer_dtypes=None, strict=False, num_blocks=2 * blocks_per_prompt + 2)
    engine = build_engine(config)
    checked = CheckedAttention(engine.runner.attention)
    engine.runner.attention = checked
    # The one-call decode step runs every layer in C, out of this check's sight: decodes go
    # layer by layer instead, through the same stage and decode kernels.
    engine.runner.lean_step = None
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for seed, length in enumerate((prompt_len, prompt_len // 2)):
        engine.add_request(random_prompt(length, engine.model_args.vocab_size, seed), params)
    run_until_done(engine)
    tolerance = _TOLERANCE[engine.runner.dtype]
    layers = [{"layer": layer, "paths": dict(counts), "max_rel_error": checked.errors[layer],
               "fallback": "reference" in counts,
               "match": checked.errors[layer] <= tolerance}
              for layer, counts in sorted(checked.attention.layer_path_counts.items())]
    pool = _pool_report(engine)
    device = engine.runner.device.type if engine.runner.device.type in DECODE_PATHS else "cpu"
    ran_fast = all(any(layer["paths"].get(p) for p in paths) for layer in layers
                   for paths in (PREFILL_PATHS[device], DECODE_PATHS[device]))
    ok = (ran_fast and checked.attention.backend.fallback_reason is None
          and all(t["format_ok"] for t in pool)
          and all(layer["match"] and not layer["fallback"] for layer in layers))
    return {"kv_dtype": kv_dtype, "ok": ok, "device": str(engine.runner.device),
            "fallback_reason": checked.attention.backend.fallback_reason,
            "tolerance": tolerance,
            "decode_kernel_unavailable": checked.attention.backend.kernel_unavailable,
            "pool": pool, "layers": layers}


def _pool_report(engine: LLMEngine) -> list[dict[str, Any]]:
    """Storage dtype and bytes of each pool tensor; data tensors must use the codec format."""
    configured = {"k": engine.runner.k_dtype, "v": engine.runner.v_dtype}
    report = []
    for name, t in engine.runner.cache.tensors().items():
        side, field = name.split("_", 1)
        expected = make_codec(configured[side], engine.model_args.head_dim).storage_dtype
        report.append({"tensor": name, "dtype": str(t.dtype).removeprefix("torch."),
                       "nbytes": t.nbytes, "shape": list(t.shape),
                       "format_ok": field != "data" or t.dtype == expected})
    return report


def verify(config: Config, kv_dtypes: list[str]) -> list[dict[str, Any]]:
    return [verify_dtype(config, kv) for kv in kv_dtypes]


def format_report(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        pool = ", ".join(f"{t['tensor']} {t['dtype']} {t['nbytes'] / 2**20:.2f} MiB" for t in r["pool"])
        lines.append(f"{r['kv_dtype']}: {'PASS' if r['ok'] else 'FAIL'} on {r['device']} ({pool})")
        if r["fallback_reason"]:
            lines.append(f"  fallback: {r['fallback_reason']}")
        if r["decode_kernel_unavailable"]:
            lines.append(f"  decode on gather + SDPA: {r['decode_kernel_unavailable']}")
        for layer in r["layers"]:
            paths = " ".join(f"{p}={n}" for p, n in sorted(layer["paths"].items()))
            flag = "" if layer["match"] and not layer["fallback"] else "  <-- FAIL"
            lines.append(f"  layer {layer['layer']:>3}: {paths}  max rel err "
                         f"{layer['max_rel_error']:.1e}{flag}")
    return "\n".join(lines)
