"""Where an engine step's time goes, per KV dtype, on one of bench compare's workloads.

Workloads (``--workload``, :mod:`slimkv.bench.compare`'s functions, default config):
``single`` (1 sequence, 128 tokens after a 16-token prompt), ``batched`` (16 x 512 random
tokens + 64 new, all at once), ``prefill`` (one prompt of ``--context`` tokens) or
``decode`` (``--seqs`` sequences at ``--context`` tokens, prefilled first, then ``--steps``
decode steps). Every dtype's engine is built and warmed up
first; the dtypes then take turns, ``--reps`` times. Three ways to look (``--how``):

- ``parts``: perf_counter around each part (monkeypatched wrappers, ~1 us each), ms per
  step, prefill steps (> 64 rows) and decode steps apart; indented parts run inside the
  one above (a part missing from this tree is left out, said so).
- ``cprofile``: the top ``--top`` functions by own time.
- ``perf``: ``perf record -e cpu-clock`` of this process (needs linux-perf and permission to
  attach), CPU ms per step of the top ``--top`` (library, symbol) pairs: the C kernels'
  own functions, which the other two see as one call.

    flock /tmp/slimkv-cpu.lock .venv/bin/python scripts/profile_step.py --how perf
    .venv/bin/python scripts/profile_step.py --kv int8 int4 --workload decode --how parts
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import importlib
import os
import pstats
import signal
import subprocess
import tempfile
import time

from slimkv.bench.compare import batched, decode_budget, decode_rate, engine_for, greedy
from slimkv.bench.compare import prefill_rate
from slimkv.config import Config
from slimkv.workload import random_prompt

# (label, module, owner, attribute); owner "" patches a module function
PARTS = [("step", "slimkv.engine.llm_engine", "LLMEngine", "step"),
         (" scheduler", "slimkv.engine.scheduler", "Scheduler", "schedule"),
         (" prepare (metadata)", "slimkv.engine.runner", "ModelRunner", "_prepare"),
         (" model forward", "slimkv.model.llama", "Transformer", "forward"),
         ("  embedding", "slimkv.model.quant", "QuantEmbedding", "forward"),
         ("  QuantLinear.fused", "slimkv.model.quant", "QuantLinear", "fused"),
         ("   prep (norm/silu -> float)", "slimkv.kernels.qgemm", "QGemm", "prep"),
         ("   dequantize W", "slimkv.kernels.qgemm", "QGemm", "dequantize"),
         ("   F.linear (float GEMM)", "torch.nn.functional", "", "linear"),
         ("   add_into (residual)", "slimkv.kernels.qgemm", "QGemm", "add_into"),
         ("   qgemm kernel", "slimkv.kernels.qgemm", "QGemm", "__call__"),
         ("  rope", "slimkv.kernels.qgemm", "QGemm", "rope"),
         ("  attention", "slimkv.attention.layer", "PagedAttention", "__call__"),
         ("   write (staging / pool)", "slimkv.attention.backend", "AttentionBackend", "write"),
         ("    KV stage kernel", "slimkv.backends.cpu_stage", "StageKernel", "__call__"),
         ("    Staging.append (a prefill chunk)", "slimkv.kv.staging", "Staging", "append"),
         ("     int8 blocks quantized (C)", "slimkv.backends.cpu_kv", "KVBlocks", "quantize"),
         ("   prefill (CPU backend)", "slimkv.backends.cpu", "CpuBackend", "prefill"),
         ("    pieces planned", "slimkv.attention.sdpa", "SdpaBackend", "pieces"),
         ("    int8 prefix read (C)", "slimkv.backends.cpu_kv", "KVBlocks", "read"),
         ("    one-call pieces (C)", "slimkv.backends.cpu_prefill", "", "one_call"),
         ("   prefill", "slimkv.attention.sdpa", "SdpaBackend", "prefill"),
         ("    read_prefix", "slimkv.kv.cache", "PagedKVCache", "read_prefix"),
         ("    prefill.run (pieces)", "slimkv.attention.prefill", "", "run"),
         ("     attend (kernel / SDPA)", "slimkv.attention.prefill", "", "attend"),
         ("   fused decode", "slimkv.backends.cpu", "CpuBackend", "decode"),
         ("    decode kernel call", "slimkv.kernels", "DecodeKernel", "__call__"),
         ("  one-call decode step (C)", "slimkv.backends.cpu_step", "LeanStep", "_run"),
         ("   its filled blocks", "slimkv.attention.layer", "PagedAttention", "after_lean_step"),
         ("  final norm", "slimkv.model.llama", "RMSNorm", "forward"),
         (" logits", "slimkv.model.llama", "Transformer", "compute_logits"),
         (" sampler", "slimkv.engine.sampling", "Sampler", "__call__"),
         (" detokenizer", "slimkv.engine.outputs", "Detokenizer", "update")]
HZ = 2000


class Steps:
    """Wraps every part (and counts the rows each forward sees) while ``on``."""

    def __init__(self) -> None:
        self.on, self.rows = False, 0
        self.total: dict[str, float] = collections.defaultdict(float)
        self.per = {kind: collections.defaultdict(float) for kind in ("prefill", "decode")}
        self.count = collections.Counter()
        for label, module, owner, attr in PARTS:
            try:
                target = importlib.import_module(module)
                target = getattr(target, owner) if owner else target
                setattr(target, attr, self.timed(label, getattr(target, attr)))
            except (ImportError, AttributeError):
                print(f"not in this tree: {module}.{owner}.{attr} ({label.strip()})")

    def timed(self, label: str, fn):
        def wrapper(*args, **kwargs):
            if label == " model forward":
                self.rows = len(args[1])
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - start
                if label == "step":
                    self.end_step()
        return wrapper

    def end_step(self) -> None:
        kind = "prefill" if self.rows > 64 else "decode" if self.rows else None
        if self.on and kind:
            self.count[kind] += 1
            for label, seconds in self.total.items():
                self.per[kind][label] += seconds
        self.total.clear()
        self.rows = 0

    def report(self, name: str) -> None:
        for kind, parts in self.per.items():
            if self.count[kind]:
                print(f"{name} {kind}: {self.count[kind]} steps, ms per step")
                for label, *_ in PARTS:
                    if parts.get(label):
                        print(f"  {label:42s} {1000 * parts[label] / self.count[kind]:8.2f}")
            parts.clear()
        self.count.clear()


def workload(name: str, engine, args) -> int:
    """Run the workload once; the number of engine steps it took (about)."""
    if name == "single":
        decode_rate(engine, 1, 16, 128)
        return 129
    if name == "prefill":  # one prompt of --context tokens, then its first token
        prefill_rate(engine, args.context)
        return -(-args.context // engine.config.scheduler.max_num_batched_tokens)
    if name == "batched":
        batched(engine, 16, 512, 64)
        return 64 + 16 * 512 // engine.config.scheduler.max_num_batched_tokens
    for _ in range(args.steps):
        engine.step()
    return args.steps


def prepared(config: Config, kv: str, args):
    """An engine per dtype; for ``decode``, its sequences prefilled and decoding."""
    new = decode_budget(config.scheduler.max_num_batched_tokens, [args.seqs], args.context,
                        (args.reps + 1) * args.steps)
    engine = engine_for(config, kv, max(args.seqs, 16), args.context + new + 600)
    prefill_rate(engine, 16)  # warm-up
    if args.workload == "decode":
        vocab = engine.model_args.vocab_size
        seqs = [engine.add_request(random_prompt(args.context, vocab, seed=i), greedy(new))
                for i in range(args.seqs)]
        while any(s.num_output_tokens == 0 for s in seqs):
            engine.step()
    workload(args.workload, engine, args)  # warm-up
    return engine


def perf_symbols(data: str, steps: int) -> dict[str, float]:
    report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort",
                             "dso,symbol", "-F", "sample,dso,symbol", "--stdio"],
                            capture_output=True, text=True, check=True).stdout
    out: dict[str, float] = collections.defaultdict(float)
    for line in report.splitlines():
        parts = line.split()
        if not line.startswith("#") and len(parts) >= 4:
            symbol = " ".join(p for p in parts[3:] if p != "-")[:40]
            out[f"{parts[1].split('-')[0][:14]} {symbol}"] += int(parts[0]) * 1000 / HZ / steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", nargs="+", default=["int8"])
    ap.add_argument("--workload", choices=["single", "batched", "decode", "prefill"],
                    default="single")
    ap.add_argument("--how", choices=["parts", "cprofile", "perf"], default="parts")
    ap.add_argument("--seqs", type=int, default=16, help="decode: sequences")
    ap.add_argument("--context", type=int, default=2048, help="decode: tokens each")
    ap.add_argument("--steps", type=int, default=8, help="decode: steps per run")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--top", type=int, default=16)
    args = ap.parse_args()
    config = Config.load()
    engines = {kv: prepared(config, kv, args) for kv in args.kv}
    steps = Steps() if args.how == "parts" else None
    columns: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for kv, engine in engines.items():
                if args.how == "parts":
                    steps.on = True
                    wall = time.perf_counter()
                    workload(args.workload, engine, args)
                    print(f"{kv} #{rep}: wall {time.perf_counter() - wall:.2f} s")
                    steps.on = False
                    steps.report(f"{kv} #{rep}")
                elif args.how == "cprofile":
                    prof = cProfile.Profile()
                    prof.enable()
                    workload(args.workload, engine, args)
                    prof.disable()
                    print(f"--- {kv} #{rep}")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
                else:
                    data = f"{tmp}/{kv}-{rep}.data"
                    perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F",
                                             str(HZ), "-p", str(os.getpid()), "-o", data],
                                            stderr=subprocess.DEVNULL)
                    time.sleep(1.0)  # perf attached
                    wall = time.perf_counter()
                    n = workload(args.workload, engine, args)
                    wall = 1000 * (time.perf_counter() - wall) / n
                    perf.send_signal(signal.SIGINT)
                    perf.wait()
                    columns[f"{kv}#{rep} ({wall:.1f} ms)"] = perf_symbols(data, n)
    if columns:
        names = sorted({n for c in columns.values() for n in c},
                       key=lambda n: -sum(c.get(n, 0.0) for c in columns.values()))[:args.top]
        print("CPU ms per step; wall ms per step in the header")
        print(" " * 56 + "  ".join(f"{c:>18s}" for c in columns))
        for name in names:
            print(f"{name:56s}" + "  ".join(f"{c.get(name, 0.0):18.1f}" for c in columns.values()))


if __name__ == "__main__":
    main()
