"""Decode-kernel builds A/B'd inside the engine: int8 and int4 engines (bench/compare's
``engine_for``, 32 sequences x 2K prefilled once), then blocks of STEPS steps with each
build's ``paged_decode`` swapped into the one-call decode step, build after build, REPS times
at 32 sequences, then at 16; prints the median ms per step and the int4 / int8 ratio per
build. Builds: shared libraries of slimkv/kernels/paged_decode.c made with the package's
flags, e.g. ``gcc $(python -c 'from slimkv.kernels.build import FLAGS; print(*FLAGS)')
OLD/paged_decode.c -o /tmp/old.so -lm``. Takes /tmp/slimkv-cpu.lock itself, so run it
WITHOUT flock:

    PYTHONPATH=$PWD .venv/bin/python scripts/engine_kernel_ab.py /tmp/old.so,/tmp/new.so [REPS] [STEPS]
"""

from __future__ import annotations

import ctypes
import statistics
import sys

from step_ab import block, cpu_lock, prepared  # scripts/ is on sys.path when run as a script

from slimkv.bench.compare import decode_budget
from slimkv.config import Config


def use(engine, address: int) -> None:
    lean = engine.runner.lean_step
    lean._fns["decode"], lean._step = address, None  # the step's arguments made again


def main() -> None:
    builds = sys.argv[1].split(",")
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    addresses = [ctypes.cast(ctypes.CDLL(b).paged_decode, ctypes.c_void_p).value for b in builds]
    config = Config.load(None)
    new = decode_budget(config.scheduler.max_num_batched_tokens, [32], 2048,
                        2 * (reps + 1) * steps * len(builds))
    engines = {}
    for kv in ("int8", "int4"):
        with cpu_lock():
            engines[kv] = prepared(config, kv, True, 2048, new)
    for batch in (32, 16):
        times = {(kv, i): [] for kv in engines for i in range(len(builds))}
        with cpu_lock():
            for engine, seqs in engines.values():
                for seq in seqs[batch:]:
                    engine.abort_request(seq.request_id)
                for address in addresses:
                    use(engine, address)
                    block(engine, 1)  # warm-up
            for _ in range(reps):
                for i, address in enumerate(addresses):
                    for kv, (engine, _) in engines.items():
                        use(engine, address)
                        times[kv, i].append(block(engine, steps))
        for i, build in enumerate(builds):
            int8, int4 = (statistics.median(times[kv, i]) for kv in ("int8", "int4"))
            print(f"b{batch} x 2048 {build}: int8 {int8:.1f} int4 {int4:.1f} ms (medians of "
                  f"{reps}), int4 / int8 {int4 / int8:.3f}", flush=True)


if __name__ == "__main__":
    main()
