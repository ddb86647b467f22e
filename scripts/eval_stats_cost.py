"""What one format costs in `slimkv eval --suite stats` (bf16 model, CPU): the seconds per
sliding window (scored as the suite does: prefill up to 1,024 tokens, project and compare
the last ~104) over N windows spread over the corpus, and per passkey probe over one probe
per placement, extrapolated to the suite's 200 windows and 80 probes, for the reference
(bf16 KV), int8 and the floor (bf16 KV prefilled 64 tokens a step). Usage:
  PYTHONPATH=$PWD .venv/bin/python scripts/eval_stats_cost.py 10
Prints one line per format, with the load average (the CPU may be shared)."""
import dataclasses, os, sys, time
from slimkv.config import Config
from slimkv.eval.harness import SUITES, eval_config, _score_window, _answer, DtypeRun
from slimkv.llm import LLM
n = int(sys.argv[1])
suite = dataclasses.replace(SUITES["stats"], keys_per_cell=1)
cfg = Config.load().replace("model", device="cpu", dtype="bfloat16")
print("load", os.getloadavg())
for dtype in ["bfloat16", "int8", "bfloat16@chunk=64"]:
    llm = LLM(eval_config(cfg, dtype, suite.max_context))
    windows = suite.windows(llm.tokenizer)
    probes = suite.probes(llm.tokenizer)
    run = DtypeRun(dtype)
    picks = windows[:: len(windows) // n][:n]
    t = time.perf_counter()
    for w, s in picks:
        _score_window([llm], [run], w, s)
    tw = (time.perf_counter() - t) / len(picks)
    t = time.perf_counter()
    _answer(llm, run, probes, False)
    tp = (time.perf_counter() - t) / len(probes)
    total = tw * len(windows) + tp * len(probes) * SUITES["stats"].keys_per_cell
    print(f"{dtype}: {tw:.2f} s/window, {tp:.2f} s/probe -> {len(windows)} windows + "
          f"{len(probes) * SUITES['stats'].keys_per_cell} probes = {total / 60:.1f} min "
          f"(load {os.getloadavg()[0]:.1f})", flush=True)
