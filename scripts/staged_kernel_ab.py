"""The staged prefill chunk's one kernel call, an older build against this checkout's, on one
layer of a chunk (SmolLM2's 9 / 3 heads of 64), interleaved in one process; also the causal
call (a bf16 cache's first chunk) of both. Builds from before the staged entry
(``prefill_attention_pieces``, which read each piece's mask) get their mask table, newer ones
(``prefill_attention_staged``) the positions table. Checks the outputs are equal bit for bit.
  mkdir /tmp/old && git archive 90521c9 slimkv/kernels | tar -x --strip-components=2 -C /tmp/old
  PYTHONPATH=. .venv/bin/python scripts/staged_kernel_ab.py /tmp/old --start 0 --tokens 512 \
      --reps 60 --out bench/results/issue47/zen4/staged_kernel_ab.json"""
import argparse
import ctypes
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slimkv.attention import prefill
from slimkv.bench.timing import environment
from slimkv.kernels import build
from slimkv.kernels.prefill_attn import SOURCE, PrefillKernel

p = argparse.ArgumentParser()
p.add_argument("old", help="a directory holding an older slimkv/kernels")
p.add_argument("--start", type=int, default=0, help="the chunk's first position")
p.add_argument("--tokens", type=int, default=512)
p.add_argument("--reps", type=int, default=40)
p.add_argument("--out")
args = p.parse_args()
HEADS, KV_HEADS, DIM, BS = 9, 3, 64, 16
gen = torch.Generator().manual_seed(0)
n, start = args.tokens, args.start
own, seq = start // BS * BS, start + n
q = torch.randn(n, HEADS, DIM, generator=gen).bfloat16()
k, v = (torch.randn(seq, KV_HEADS, DIM, generator=gen).bfloat16() for _ in range(2))
sk, sv = (torch.randn(seq - own, KV_HEADS, DIM, generator=gen).bfloat16() for _ in range(2))
pieces = prefill.plan(seq, n, own, BS, torch.bfloat16, torch.device("cpu"))


def load(directory: Path) -> tuple[PrefillKernel, object, torch.Tensor]:
    tmp = Path(tempfile.mkdtemp())  # build.load keys the library on the source's folder
    for f in (*directory.glob("prefill_attention.c"), *directory.glob("*.h")):
        shutil.copy(f, tmp)
    lib = build.load(tmp / "prefill_attention.c")
    assert not isinstance(lib, str), lib
    fn = getattr(lib, "prefill_attention_staged", None)
    rows = [(x.rows.start, x.rows.stop, x.num_pool_keys, x.staged.start, x.staged.stop)
            for x in pieces]
    if fn is None:  # the mask table
        fn = lib.prefill_attention_pieces
        table = [(*r, x.mask.data_ptr(), x.mask.stride(0)) for r, x in zip(rows, pieces)]
    else:
        table = [(*r, start + x.rows.start, BS) for r, x in zip(rows, pieces)]
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    build.signature(fn, [ptr, i64] * 5 + [ptr, i32, ptr, i64, i32, i32, i32, ctypes.c_float])
    return PrefillKernel(lib), fn, torch.tensor(table, dtype=torch.int64)


def staged(fn, table) -> torch.Tensor:
    out = torch.empty_like(q)
    fn(*(a for x in (q, k, v, sk, sv) for a in (x.data_ptr(), x.stride(0))), table.data_ptr(),
       len(table), out.data_ptr(), out.stride(0), HEADS, KV_HEADS, DIM, DIM ** -0.5)
    return out


builds = {"old": load(Path(args.old)), "new": load(SOURCE.parent)}
fns = {}
for name, (kernel, fn, table) in builds.items():
    fns[f"{name} staged"] = lambda fn=fn, table=table: staged(fn, table)
    if start == 0:
        fns[f"{name} causal"] = lambda kernel=kernel: kernel(q, k[:n], v[:n], None, DIM ** -0.5)
equal = {case: torch.equal(fns[f"old {case}"]().view(torch.int16),
                           fns[f"new {case}"]().view(torch.int16))
         for case in ("staged", "causal") if f"old {case}" in fns}
runs = {name: [] for name in fns}
for _ in range(args.reps):
    for name, f in fns.items():
        t = time.perf_counter()
        for _ in range(5):
            f()
        runs[name].append((time.perf_counter() - t) / 5 * 1e3)
medians = {name: round(statistics.median(r), 3) for name, r in runs.items()}
result = {"machine": environment(), "old": args.old, "start": start, "tokens": n,
          "reps": args.reps, "unit": "ms per layer call (median of reps, 5 calls each)",
          "bit_equal": equal, "medians": medians,
          "new_over_old": {case: round(medians[f"new {case}"] / medians[f"old {case}"], 3)
                           for case in equal},
          "runs": runs}
print(json.dumps({x: result[x] for x in ("bit_equal", "medians", "new_over_old")}, indent=1))
if args.out:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
