"""Engine decode step, 32 and 16 sequences x 2K tokens, KV dtypes (and optionally ordinary 4 KiB
pages for the pool, ``--pages both``) alternated in one process: every variant's engine
(bench/compare's ``engine_for``) is prefilled once, then blocks of STEPS steps run in turn,
variant after variant, REPS times at 32 sequences, then again at 16; best and median block
kept. Takes /tmp/slimkv-cpu.lock itself, one phase at a time (each engine's prefill, each
batch size's measurement), so run it WITHOUT flock:

    PYTHONPATH=$PWD .venv/bin/python scripts/step_ab.py --kv int8 int4 bfloat16 --reps 5
"""

from __future__ import annotations

import argparse
import fcntl
import statistics
import time
from contextlib import contextmanager

import torch

import slimkv.kv.cache as cache_module
from slimkv.bench.compare import decode_budget, engine_for, greedy, prefill_rate
from slimkv.config import Config
from slimkv.workload import random_prompt


@contextmanager
def cpu_lock():
    with open("/tmp/slimkv-cpu.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ordinary(shape, value, dtype, device):
    return torch.full(shape, value, dtype=dtype, device=device)


def prepared(config: Config, kv: str, huge: bool, context: int, new_tokens: int,
             num_seqs: int = 32):
    real = cache_module.filled
    cache_module.filled = real if huge else ordinary
    try:
        engine = engine_for(config, kv, num_seqs, context + new_tokens + 16)
    finally:
        cache_module.filled = real
    prefill_rate(engine, 16)  # warm-up
    vocab = engine.model_args.vocab_size
    seqs = [engine.add_request(random_prompt(context, vocab, seed=i), greedy(new_tokens))
            for i in range(num_seqs)]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    return engine, seqs


def block(engine, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return 1000 * (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv", nargs="+", default=["int8", "int4", "bfloat16"])
    parser.add_argument("--pages", choices=["huge", "both"], default="huge")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048)
    args = parser.parse_args()
    config = Config.load(None)
    pages = [True] if args.pages == "huge" else [False, True]
    # the tokens decoded while the others prefill, then every measured step
    chunk = config.scheduler.max_num_batched_tokens
    new_tokens = decode_budget(chunk, [32], args.context, 2 * (args.reps + 1) * args.steps)
    variants = {}
    for kv in args.kv:
        for huge in pages:
            with cpu_lock():
                variants[kv, huge] = prepared(config, kv, huge, args.context, new_tokens)
            print(f"prefilled {kv} huge={huge}", flush=True)
    for batch in (32, 16):
        times = {key: [] for key in variants}
        with cpu_lock():
            for engine, seqs in variants.values():
                for seq in seqs[batch:]:
                    engine.abort_request(seq.request_id)
                block(engine, 1)  # warm-up at this batch size
            for _ in range(args.reps):
                for key, (engine, _) in variants.items():
                    times[key].append(block(engine, args.steps))
        if any(seq.is_finished for _, seqs in variants.values() for seq in seqs[:batch]):
            raise RuntimeError("a sequence finished inside the measured decode steps")
        for (kv, huge), ms in times.items():
            print(f"b{batch} x {args.context} {kv} huge={huge}: best {min(ms):.1f} median "
                  f"{statistics.median(ms):.1f} ms  [{' '.join(f'{t:.0f}' for t in ms)}]",
                  flush=True)


if __name__ == "__main__":
    main()
