"""The scoring half of `slimkv eval --suite quick` (the same corpus windows, engine configs
and statistics as slimkv/eval/harness.py's run_eval, without the recall probes), one KV
dtype's engine at a time so that only two are alive: perplexity change, mean KL and top-1
agreement against float32 KV, with float32 weights (bench/eval/float32-weights.yaml).

    PYTHONPATH=. python scripts/eval_int4_options.py 2 int4:per_channel_block,int4:per_token+g64+rotate_k

Arguments: the number of windows, then the dtypes in eval_config's syntax (issue 46's
``+g64+rotate_k+rotate_v`` included). Prints one line per dtype; writes nothing."""
import sys, time
import torch
from slimkv.config import Config
from slimkv.eval import corpus
from slimkv.eval.harness import SUITES, eval_config, DtypeRun
from slimkv.eval.perplexity import next_token_logprobs
from slimkv.llm import LLM

config = Config.load("bench/eval/float32-weights.yaml")
suite = SUITES["quick"]
windows_n = int(sys.argv[1]) if len(sys.argv) > 1 else suite.num_windows
dtypes = sys.argv[2].split(",")
ref = LLM(eval_config(config, "float32", suite.max_context))
windows = corpus.windows(ref.tokenizer, suite.window, windows_n)
refs = [next_token_logprobs(ref.engine.score(w)) for w in windows]
base = DtypeRun("float32")
for w, r in zip(windows, refs):
    base.stats.add(r, torch.tensor(w[1:]), r)
del ref
print(f"{len(windows)} windows x {suite.window} tokens; float32 KV ppl {base.stats.perplexity:.4f}", flush=True)
for dtype in dtypes:
    t = time.time()
    llm = LLM(eval_config(config, dtype, suite.max_context))
    run = DtypeRun(dtype)
    for w, r in zip(windows, refs):
        run.stats.add(next_token_logprobs(llm.engine.score(w)), torch.tensor(w[1:]), r)
    s = run.stats
    print(f"{dtype:<42} {llm.engine.runner.bytes_per_token:>7} B/token  ppl {100 * (s.perplexity / base.stats.perplexity - 1):+.3f}%  "
          f"KL {s.mean_kl:.5f}  top-1 {100 * s.top1_agreement:.2f}%  ({time.time() - t:.0f} s)", flush=True)
    del llm
