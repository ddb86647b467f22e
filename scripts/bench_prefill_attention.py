"""One layer's prefill attention (cache write + attention) for one 512-token chunk, at
SmolLM2-135M's shapes (9 q / 3 kv heads, D 64, block 16, bf16), for several PIECE sizes:
median ms of many calls, the sizes interleaved so host noise hits them alike.

    flock /tmp/slimkv-cpu.lock timeout 200 .venv/bin/python scripts/bench_prefill_attention.py
"""
import statistics
import sys
import time

import torch

from slimkv.attention import prefill
from slimkv.attention.paged import AttentionMetadata, PagedAttention
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import Staging

H, KV, D, BS, N = 9, 3, 64, 16, 512
bf = torch.bfloat16


def setup(kv: str, start: int):
    scaled = "per_channel_block" if kv == "int8" else "per_token"
    cache = PagedKVCache(num_layers=1, num_blocks=80, block_size=BS, num_kv_heads=KV,
                         head_dim=D, k_dtype=kv, v_dtype=kv, k_scale=scaled,
                         device=torch.device("cpu"))
    staging = Staging(cache, 2, bf) if cache.block_scaled else None
    attn = PagedAttention(cache, H, 0.125, bf, staging=staging)
    q, k, v = (torch.randn(N, h, D).to(bf) for h in (H, KV, KV))
    table = [list(range(1, 70))]
    def call():
        meta = AttentionMetadata.build(BS, table, [N], [start + N], torch.device("cpu"),
                                       None if staging is None else [1])
        return attn(0, q, k, v, meta)
    return call


times: dict[tuple, list[float]] = {}
pieces = [int(p) for p in sys.argv[1:]] or [64, 128, 256, 4096]
cases = [(kv, start, p) for kv in ("int8", "bfloat16") for start in (0, 512) for p in pieces]
calls = {(kv, start): setup(kv, start) for kv, start, _ in cases}
for _ in range(15):
    for kv, start, p in cases:
        prefill.PIECE = p
        call = calls[(kv, start)]
        t = time.perf_counter()
        for _ in range(3):
            call()
        times.setdefault((kv, start, p), []).append((time.perf_counter() - t) / 3 * 1e3)
for key, ts in times.items():
    print(key, "median ms %.2f" % statistics.median(ts), "min %.2f" % min(ts))
