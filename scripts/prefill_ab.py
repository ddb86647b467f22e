"""A/B of prefill attention kernel builds (and torch's SDPA) on one layer of a 512-token chunk
at SmolLM2-135M's shapes (9 q / 3 kv heads, D 64, blocks of 16, bf16): each SOURCE_DIR (a
copy of slimkv/kernels, e.g. from `git show REV:slimkv/kernels/...`) is built with the
package's flags; `sdpa` is torch's. Per build, the chunk that starts an unstaged sequence
(one causal call) and the same chunk on a staged cache (int8 KV: PIECE-row pieces over pool
and staged keys under additive masks), called in turn REPS times: median and best ms, and
whether each build's output equals the first's bit for bit.

    flock /tmp/slimkv-cpu.lock .venv/bin/python scripts/prefill_ab.py OLD_DIR,slimkv/kernels,sdpa [REPS]
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sdpa_variants import interleaved_ms  # noqa: E402

from slimkv.attention import prefill  # noqa: E402
from slimkv.kernels.build import FLAGS  # noqa: E402
from slimkv.kernels.prefill_attn import PrefillKernel  # noqa: E402
from slimkv.kv.staging import StagedKV  # noqa: E402

N, HQ, HKV, D, BS = 512, 9, 3, 64, 16


def build(spec: str, out: Path) -> PrefillKernel | None:
    if spec == "sdpa":
        return None
    subprocess.run(["gcc", *FLAGS, f"{spec}/prefill_attention.c", "-o", str(out), "-lm"],
                   check=True)
    return PrefillKernel(ctypes.CDLL(str(out)))


def main() -> None:
    specs = sys.argv[1].split(",")
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    torch.manual_seed(0)
    q = torch.randn(N, HQ, D).bfloat16()
    k, v = torch.randn(N, HKV, D).bfloat16(), torch.randn(N, HKV, D).bfloat16()
    cases = {"causal": (prefill.plan(N, N, None, BS, torch.bfloat16, torch.device("cpu")), None),
             "staged": (prefill.plan(N, N, 0, BS, torch.bfloat16, torch.device("cpu")),
                        StagedKV(0, k, v))}
    with tempfile.TemporaryDirectory() as tmp:
        kernels = [build(spec, Path(tmp) / f"k{i}.so") for i, spec in enumerate(specs)]
        for case, (pieces, staged) in cases.items():
            def call(kernel):
                def run():
                    prefill.prefill_kernel = lambda: kernel
                    return prefill.run(pieces, q, k, v, staged, D ** -0.5)
                return run
            fns = {spec: call(kernel) for spec, kernel in zip(specs, kernels)}
            first = next(iter(fns.values()))()
            for spec, ms in interleaved_ms(fns, reps).items():
                same = torch.equal(fns[spec](), first)
                print(f"{case:6s} {spec:28s} median {statistics.median(ms):6.2f} ms, best "
                      f"{min(ms):6.2f}, equal to the first: {same}", flush=True)


if __name__ == "__main__":
    main()
