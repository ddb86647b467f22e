"""Prefill 512 tokens and 8 sequences x 128 tokens on bf16 KV with whatever slimkv is on the
path: run it for two checkouts in turn to compare code versions side by side, e.g.
  for r in 1 2 3; do for d in OLD NEW; do (cd $d && PYTHONPATH=$d .venv/bin/python scripts/ab_versions.py); done; done
Prints {"prefill512": tok/s (median of 5), "parallel8": tok/s (median of 3)}."""
import json, statistics, sys, time
import torch
from slimkv.config import Config
from slimkv.plugins import build_engine
from slimkv.engine.sampling_params import SamplingParams
from slimkv.workload import random_prompt
cfg = Config.from_dict({"kv_cache": {"dtype": "bfloat16"}})
e = build_engine(cfg)
V = e.model_args.vocab_size
def prefill(n, seed):
    e.add_request(random_prompt(n, V, seed), SamplingParams(max_tokens=1, temperature=0))
    t = time.perf_counter()
    while e.has_unfinished(): e.step()
    return n / (time.perf_counter() - t)
def parallel8(seed):
    for i in range(8):
        e.add_request(random_prompt(16, V, seed + i), SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
    e.step()  # the prefill
    t = time.perf_counter(); n = 0
    while e.has_unfinished():
        n += len(e.step())
    return n / (time.perf_counter() - t)
prefill(512, 99); parallel8(50)
p = [prefill(512, s) for s in range(5)]
d = [parallel8(100 + 10 * s) for s in range(3)]
print(json.dumps({"prefill512": statistics.median(p), "parallel8": statistics.median(d)}))
