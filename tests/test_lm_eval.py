"""lm-evaluation-harness (the real client, its ``lm-eval run`` CLI in a subprocess) scores a
small multiple-choice task, defined from a JSONL file written to a temp dir, against a live
server with ``local-completions``: token-id prompts in batches, ``echo`` with ``logprobs``,
its ``tokenizer_backend=remote`` reading the server's ``/tokenizer_info``, ``/tokenize`` and
``/detokenize``. Every choice's log-likelihood, and so the accuracy, must equal a scoring of
the same items by the engine's own ``score()`` exactly (issue 45)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import API_KEY, small_config

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

ITEMS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Water freezes at a temperature of zero degrees", ["Celsius", "Kelvin", "Newton"], 0),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus"], 1),
    ("A week has seven", ["days", "hours", "months"], 0),
    ("The opposite of hot is", ["loud", "cold", "tall"], 1),
    ("Bees make", ["milk", "honey", "silk"], 1),
    ("The sun rises in the", ["west", "north", "east"], 2),
    ("Two plus two equals", ["five", "four", "three"], 1),
    ("The chemical symbol for gold is", ["Ag", "Fe", "Au"], 2),
    ("Shakespeare wrote", ["Hamlet", "Dracula", "Frankenstein"], 0),
]
TASK = """task: slimkv_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def reference_loglikelihoods(engine, context: str, choices: list[str]) -> list[float]:
    """lm-eval's own split (its ``_encode_pair``: the whole text encoded, the context's
    tokens cut off) scored by ``score()``, the continuation's logprobs summed in order."""
    encode = lambda text: engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    context_ids = encode(context)
    sums = []
    for choice in choices:
        ids = encode(context + " " + choice)
        raw = engine.score(ids).float().log_softmax(-1)
        sums.append(sum(raw[i - 1, ids[i]].item() for i in range(len(context_ids), len(ids))))
    return sums


def run_lm_eval(server, tmp_path) -> tuple[dict, list[dict]]:
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in ITEMS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "slimkv_tiny_mc.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "out"
    model_args = ",".join([
        f"model={server.model}", f"base_url={server.base_url}/completions",
        "tokenizer_backend=remote", f"auth_token={API_KEY}", "num_concurrent=1",
        "max_retries=1", "tokenized_requests=True"])
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    done = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
         "--model_args", model_args, "--tasks", "slimkv_tiny_mc", "--include_path",
         str(tasks), "--batch_size", "4", "--output_path", str(out), "--log_samples"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(open(glob.glob(f"{out}/**/results_*.json", recursive=True)[0]).read())
    samples_file = glob.glob(f"{out}/**/samples_slimkv_tiny_mc_*.jsonl", recursive=True)[0]
    samples = [json.loads(line) for line in open(samples_file)]
    print(done.stdout[-2000:])  # lm-eval's table, for the record (pytest -s)
    return results, samples


def test_lm_eval_accuracy_equals_the_engines_own_scoring(server, tmp_path):
    from slimkv.plugins import build_engine

    results, samples = run_lm_eval(server, tmp_path)
    reference = build_engine(small_config())  # the server's engine config
    with torch.inference_mode():
        want = {q: reference_loglikelihoods(reference, q, c) for q, c, _ in ITEMS}
    assert len(samples) == len(ITEMS)
    correct = []
    for sample in samples:
        doc = sample["doc"]
        got = [float(r[0]) for r in sample["filtered_resps"]]
        assert got == want[doc["question"]], doc["question"]  # exactly, choice by choice
        correct.append(int(np.argmax(want[doc["question"]])) == doc["answer"])
    accuracy = results["results"]["slimkv_tiny_mc"]["acc,none"]
    assert accuracy == sum(correct) / len(correct)
