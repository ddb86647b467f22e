"""A 512-token causal prefill chunk's attention at SmolLM2-135M's shapes (9 q / 3 kv heads,
D 64), one layer: torch's SDPA (CPU flash kernel) against two ways around it, in bf16 and
float32, the variants called in turn REPS times (so host noise hits them alike): median and
best ms, and the largest difference from float32 SDPA:

- ``mm``: scores by one batched matmul per kv head (float32), additive causal mask, softmax,
  P.V in the input dtype;
- ``blockedB``: query blocks of B rows, each over the keys up to its end with the
  diagonal block masked (skips the upper triangle beyond the flash kernel's own blocking).

    flock /tmp/slimkv-cpu.lock .venv/bin/python scripts/bench_sdpa_variants.py [REPS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

N = L = 512
HQ, HKV, D = 9, 3, 64


def interleaved_ms(fns: dict, reps: int) -> dict[str, list[float]]:
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def variants(q, k, v):
    dt, group = q.dtype, HQ // HKV
    mask = torch.zeros(N, L).masked_fill_(~torch.ones(N, L, dtype=torch.bool).tril(), float("-inf"))
    grouped_mask = mask.expand(HKV, group, N, L).reshape(HKV, group * N, L)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def mm():
        s = torch.baddbmm(grouped_mask, q[0].reshape(HKV, group * N, D).float(),
                          k[0].float().transpose(1, 2), alpha=D ** -0.5)
        return (torch.softmax(s, -1).to(dt) @ v[0]).view(1, HQ, N, D)

    def blocked(rows: int):
        def run():
            out = torch.empty_like(q)
            diag = torch.zeros(rows, rows, dtype=dt).masked_fill_(
                ~torch.ones(rows, rows, dtype=torch.bool).tril(), float("-inf"))
            for s0 in range(0, N, rows):
                end = s0 + rows
                m = torch.zeros(rows, end, dtype=dt)
                m[:, s0:] = diag
                out[:, :, s0:end] = F.scaled_dot_product_attention(
                    q[:, :, s0:end], k[:, :, :end], v[:, :, :end], attn_mask=m, enable_gqa=True)
            return out
        return run

    return {"sdpa": sdpa, "mm": mm, "blocked128": blocked(128), "blocked256": blocked(256)}


def main(reps: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    q32, k32 = torch.randn(1, HQ, N, D), torch.randn(1, HKV, L, D)
    v32 = torch.randn_like(k32)
    ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
    for dt in (torch.bfloat16, torch.float32):
        q, k, v = q32.to(dt), k32.to(dt), v32.to(dt)
        fns = variants(q, k, v)
        for name, ms in interleaved_ms(fns, reps).items():
            err = (fns[name]().float() - ref).abs().max().item()
            print(f"{str(dt):15s} {name:11s} median {statistics.median(ms):6.2f} ms, best "
                  f"{min(ms):6.2f}  max diff {err:.1e}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)
