"""The batched workload (16 x 512 + 64, all at once): wall, per-step ms, optional cProfile.

    flock /tmp/slimkv-cpu.lock timeout 200 .venv/bin/python scripts/prof_batched.py int8 [prof]
(CHUNK=1024 in the environment sets scheduler.max_num_batched_tokens.)
"""
import os, sys, time, cProfile, pstats
from slimkv.config import Config
from slimkv.bench.compare import engine_for, batched
kv = sys.argv[1] if len(sys.argv) > 1 else "int8"
cfg = Config.load()
if os.environ.get("CHUNK"):  # scheduler.max_num_batched_tokens
    cfg = cfg.replace("scheduler", max_num_batched_tokens=int(os.environ["CHUNK"]))
eng = engine_for(cfg, kv, 16, 512 + 64)
batched(eng, 2, 64, 4)  # warm
# time steps
orig = eng.step
times = []
def step():
    t = time.perf_counter(); r = orig(); times.append(time.perf_counter() - t); return r
eng.step = step
if len(sys.argv) > 2:
    pr = cProfile.Profile(); pr.enable()
r = batched(eng, 16, 512, 64)
if len(sys.argv) > 2:
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(25)
print(r, "steps", len(times))
big = [t for t in times if t > 0.1]
print("steps>0.1s", len(big), round(sum(big),2), "rest", len(times)-len(big), round(sum(times)-sum(big),2))
print([round(t*1000) for t in times[:20]], [round(t*1000) for t in times[-10:]])
