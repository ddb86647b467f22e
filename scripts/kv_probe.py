"""Fake-quantization probe for issue #9 item 2: do attention sinks kept at full precision or a
Hadamard rotation of K and V before quantization lower the KV quantization loss?

One float32-KV engine scores corpus windows; its attention function is wrapped so each
layer's K and V are quantized and dequantized (with the real codecs) before they are
cached. Every token is quantized, the last partial block included (the engine's staging
keeps that one at full precision), so absolute losses are slightly above the harness's;
only the differences between variants matter here.

    PYTHONPATH=. .venv/bin/python scripts/kv_probe.py --windows 2

Measured numbers and the decision (neither kept): README, "KV scale layouts".
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor

from slimkv.config import Config
from slimkv.engine.llm_engine import LLMEngine
from slimkv.eval import corpus
from slimkv.eval.perplexity import TokenStats, next_token_logprobs
from slimkv.kv.cache import side_codec
from slimkv.kv.quant import KVCodec

BLOCK = 16


def hadamard(n: int) -> Tensor:
    """The normalized (orthogonal, symmetric) Sylvester Hadamard matrix of order ``n``."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)))
    return h / n ** 0.5


def fake_quant(codec: KVCodec, x: Tensor, sinks: int, rotate: Tensor | None) -> Tensor:
    """``x [T, H, D]`` through ``codec``; the first ``sinks`` tokens kept exact and left out
    of the block scales (replaced by token ``sinks`` while quantizing)."""
    y = x.float() @ rotate if rotate is not None else x.float()
    if sinks:
        y = y.clone()
        y[:sinks] = y[sinks]
    if codec.block_aux_widths:
        blocks = y.unflatten(0, (-1, BLOCK))
        out = codec.dequantize(codec.quantize(blocks), torch.float32).flatten(0, 1)
    else:
        out = codec.dequantize(codec.quantize(y), torch.float32)
    if rotate is not None:
        out = out @ rotate.T
    out[:sinks] = x[:sinks].float()
    return out.to(x.dtype)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--schemes", help="comma-separated scheme names (default: all)")
    args = p.parse_args()
    config = Config.load().replace("kv_cache", dtype="float32", num_blocks=160)
    config = config.replace("scheduler", max_num_batched_tokens=2048)
    engine = LLMEngine(config)
    real = engine.runner.attention
    head_dim = engine.model_args.head_dim
    rot = hadamard(head_dim)
    schemes = {
        "int8 per_token": (side_codec("int8", head_dim, "per_token"),
                           side_codec("int8", head_dim, "per_token")),
        "int8 pcb": (side_codec("int8", head_dim, "per_channel_block"),
                     side_codec("int8", head_dim, "per_token")),
        "int4 pcb/g32": (side_codec("int4", head_dim, "per_channel_block"),
                         side_codec("int4", head_dim, "per_token")),
        "int4 g32/g32": (side_codec("int4", head_dim, "per_token"),
                         side_codec("int4", head_dim, "per_token")),
    }
    if args.schemes:
        schemes = {name: schemes[name] for name in args.schemes.split(",")}
    variants = {"plain": (0, None), "sinks4": (4, None), "sinks16": (16, None),
                "hadamard": (0, rot), "hadamard+sinks16": (16, rot)}
    windows = corpus.windows(engine.tokenizer, 1024, args.windows)
    refs = []
    for w in windows:
        refs.append(next_token_logprobs(engine.score(w)))
    print(f"{'scheme':<16} {'variant':<18} {'ppl %':>8} {'KL':>9} {'top1 %':>7}")
    ref_stats = TokenStats()
    for w, ref in zip(windows, refs):
        ref_stats.add(ref, torch.tensor(w[1:]), ref)
    for scheme, (kc, vc) in schemes.items():
        for variant, (sinks, rotate) in variants.items():
            def attn(layer, q, k, v, meta, kc=kc, vc=vc, sinks=sinks, rotate=rotate):
                return real(layer, q, fake_quant(kc, k, sinks, rotate),
                            fake_quant(vc, v, sinks, rotate), meta)
            engine.runner.attention = attn
            stats = TokenStats()
            for w, ref in zip(windows, refs):
                stats.add(next_token_logprobs(engine.score(w)), torch.tensor(w[1:]), ref)
            engine.runner.attention = real
            ppl = 100 * (stats.perplexity / ref_stats.perplexity - 1)
            print(f"{scheme:<16} {variant:<18} {ppl:>+8.3f} {stats.mean_kl:>9.6f} "
                  f"{100 * stats.top1_agreement:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
