"""Issue 46's tail-length row, *emulated* for teacher-forced scoring (not built in the cache).

KIVI keeps the most recent tokens at full precision. slimkv's staged cache keeps exactly a
query's own block (1-16 tokens) at full precision; the earlier blocks are read quantized.
Here the prefill plan (:func:`slimkv.attention.prefill.plan`, which the step's metadata
takes) is replaced by one in which a query at position p also sees the ``tail`` tokens before
its block, ``[block_start(p) - tail, block_start(p))``, at full precision, from the chunk's
own staged keys: every perplexity window (1,024 tokens) is scored in one chunk from position 0
(the harness's step budget is 2,048), so those keys are all there, and every backend
(the C one-call kernel, the torch pieces) reads the plan's masks. ``--tails 0`` is the plain
engine and must reproduce the committed row (a check of this script). Decode steps are not
emulated, so no passkey is scored here; the tail's cost in a real cache (bytes, a staging
slot and flush spanning several blocks, every kernel's staged read) is not built.

  PYTHONPATH=. .venv/bin/python scripts/tail_ablation.py --tails 0,32,112 \\
      --out bench/results/issue46/tail-ablation.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
from tqdm import tqdm

from slimkv.attention import metadata, prefill
from slimkv.bench.timing import environment
from slimkv.config import Config
from slimkv.eval.harness import SUITES, DtypeRun, EvalRun, eval_config
from slimkv.eval.perplexity import next_token_logprobs
from slimkv.eval.report import intervals, metrics
from slimkv.llm import LLM

TAIL = {"tokens": 0}
_plain = prefill.plan


def plan_with_tail(seq_len, query_len, staged_start, block_size, dtype, device, piece=None):
    """:func:`prefill.plan` where a staged query's full-precision keys start ``TAIL`` tokens
    before its own block (never before the chunk's staged keys)."""
    tail = TAIL["tokens"]
    if staged_start is None or tail == 0:
        return _plain(seq_len, query_len, staged_start, block_size, dtype, device, piece)
    start, piece = seq_len - query_len, piece or prefill.PIECE
    pieces = []
    for first in range(start, seq_len, piece):
        last = min(first + piece, seq_len)
        pos = torch.arange(first, last, device=device)[:, None]           # [rows, 1]
        float_from = (pos // block_size * block_size - tail).clamp(min=staged_start)
        pool, own = int(float_from[-1]), int(float_from[0])
        pool_pos = torch.arange(pool, device=device)[None]
        staged_pos = torch.arange(own, last, device=device)[None]
        mask = torch.cat((pool_pos < float_from,
                          (staged_pos >= float_from) & (staged_pos <= pos)), 1)
        pieces.append(prefill.Piece(slice(first - start, last - start), pool,
                                    slice(own - staged_start, last - staged_start),
                                    prefill._additive(mask, dtype)))
    return pieces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="bench/eval/float32-weights.yaml")
    ap.add_argument("--kv-dtype", default="int4+rotate_k+rotate_v")
    ap.add_argument("--tails", default="0,32,112", help="tokens before a query's own block")
    ap.add_argument("--windows", type=int, help="only the first N of the stats suite's 200")
    ap.add_argument("--out")
    args = ap.parse_args()
    tails = [int(t) for t in args.tails.split(",")]
    suite = SUITES["stats"]
    config = Config.load(args.config)
    if args.windows:
        suite = dataclasses.replace(suite, num_windows=args.windows)
    metadata.plan = plan_with_tail  # what AttentionMetadata.build calls
    started = time.time()
    llms = [LLM(eval_config(config, d, suite.window)) for d in ("float32", args.kv_dtype)]
    ref, runs = DtypeRun("float32"), {t: DtypeRun(f"{args.kv_dtype} tail={t}") for t in tails}
    for window, scored in tqdm(suite.windows(llms[0].tokenizer), desc="windows"):
        reference = next_token_logprobs(llms[0].engine.score(window, last=scored + 1))
        targets = torch.tensor(window[len(window) - scored:])
        ref.add_window(reference, targets, reference)
        for tail, run in runs.items():
            TAIL["tokens"] = tail
            run.add_window(next_token_logprobs(llms[1].engine.score(window, last=scored + 1)),
                           targets, reference)
    ev = EvalRun(suite, llms[0].engine.model_name, 0, [], ref, list(runs.values()))
    rows = {}
    for tail, run in runs.items():
        iv = intervals(run, ev)
        rows[tail] = {**{k: [iv[k].value, iv[k].low, iv[k].high] for k in iv},
                      "perplexity": metrics(run, ev)["perplexity"],
                      "tokens": run.stats.tokens}
        print(tail, rows[tail])
    result = {"machine": environment(), "command": "scripts/tail_ablation.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v),
              "kv_dtype": args.kv_dtype, "windows": len(ref.windows),
              "reference_perplexity": metrics(ref, ev)["perplexity"],
              "elapsed_s": round(time.time() - started, 1), "tails": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
