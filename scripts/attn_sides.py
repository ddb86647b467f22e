"""The fused decode kernel at 32 sequences x 2K (30 layers, SmolLM2's shape) with K and V in
different formats (int8 / int4 each, per-channel block key scales), the four combinations
called in turn 8 times: best and median ms per whole step. Says which side an int4 cache's
extra cost is on.

    flock /tmp/slimkv-cpu.lock .venv/bin/python scripts/attn_sides.py
"""
import statistics
import time

import torch

from slimkv.kernels import decode_kernel, describe
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import Staging
torch.set_num_threads(2)
B, CTX, LAYERS, BS = 32, 2048, 30, 16
def make(kd, vd):
    per_seq = -(-(CTX + 1) // BS); nb = B * per_seq + 1
    cache = PagedKVCache(num_layers=LAYERS, num_blocks=nb, block_size=BS, num_kv_heads=3, head_dim=64, k_dtype=kd, v_dtype=vd, k_scale="per_channel_block", device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for s in range(0, nb, 512):
        ids = torch.arange(s, min(s + 512, nb))
        cache.write_blocks(0, ids, torch.randn(len(ids), BS, 3, 64, generator=gen), torch.randn(len(ids), BS, 3, 64, generator=gen))
    for t in cache.tensors().values(): t[1:] = t[0]
    st = Staging(cache, B, torch.bfloat16); st.buffer.normal_(generator=gen)
    tables = (torch.randperm(nb - 1, generator=gen) + 1)[:B * per_seq].view(B, per_seq).contiguous()
    lens = torch.full((B,), CTX + 1, dtype=torch.long)
    sides = [tuple(describe(cache.layer_codecs[l][s], cache.layer_pool(s, l)) for s in "kv") for l in range(LAYERS)]
    q = torch.randn(B, 9, 64); slots = torch.arange(B); kern = decode_kernel()
    def step():
        for l in range(LAYERS):
            kern(q, tables, lens, *sides[l], 3, BS, 0.125, (*st.layer_buffers(l), slots))
    return step, cache
combos = [("int8", "int8"), ("int4", "int8"), ("int8", "int4"), ("int4", "int4")]
steps = {}
for c in combos:
    steps[c] = make(*c)
times = {c: [] for c in combos}
for _ in range(8):
    for c in combos:
        f = steps[c][0]; t = time.perf_counter(); f(); times[c].append((time.perf_counter() - t) * 1e3)
for c in combos: print(c, "best %.1f median %.1f" % (min(times[c]), statistics.median(times[c])))
