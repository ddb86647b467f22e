"""Canary on live traffic: shadow a fraction of served requests through a reference KV dtype.

Models differ in how much KV quantization hurts them (MISSION item 11), so a new model's
quantized default is trusted only once live traffic agrees with a reference. After a
greedy request finishes, the engine thread offers it here; a canary thread (off the
response path: the client already has its answer) teacher-forces prompt + served output
through a second engine whose KV cache uses ``canary.reference_dtype`` and compares, at
every output position, the reference's greedy choice with the token that was served:
- token agreement: fraction of positions where they are the same token;
- first divergence: the first position where they differ (observed for diverging requests);
- mean logprob delta: mean of log p_ref(reference choice) - log p_ref(served), >= 0 (how
  much less likely the reference found the served tokens; a histogram, so non-negative).
Extra memory is bounded: the reference engine's own small KV pool (``canary.memory_gb``)
shares the served model's weights (the loader caches them), and at most
``canary.max_pending`` requests wait; beyond that an offer is dropped and counted.
"""

from __future__ import annotations

import logging
import queue
import random
import threading

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from slimkv.config import Config
from slimkv.engine.llm_engine import RequestError
from slimkv.plugins import build_engine
from slimkv.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

AGREEMENT_BUCKETS = (0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)
POSITION_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
LOGPROB_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class Canary:
    def __init__(self, config: Config, registry: CollectorRegistry, model_name: str) -> None:
        self.fraction = config.canary.fraction
        self._rng = random.Random(0)
        self.engine = build_engine(config.replace(
            "kv_cache", dtype=config.canary.reference_dtype, k_dtype=None, v_dtype=None,
            layer_dtypes=None, memory_gb=config.canary.memory_gb, num_blocks=None,
            enable_prefix_caching=False))
        self._queue: queue.Queue[tuple[list[int], list[int]] | None] = queue.Queue(
            config.canary.max_pending)
        labels = {"model_name": model_name, "reference_dtype": config.canary.reference_dtype}

        def metric(cls, name: str, doc: str, **kwargs):
            return cls(f"slimkv:{name}", doc, list(labels), registry=registry,
                       **kwargs).labels(**labels)

        self.requests = metric(Counter, "canary_requests", "Requests compared by the canary.")
        self.dropped = metric(Counter, "canary_dropped", "Canary offers dropped (queue full or too long).")
        self.diverged = metric(Counter, "canary_diverged_requests", "Canary requests whose tokens diverged.")
        self.agreement = metric(Histogram, "canary_token_agreement",
                                "Per request: fraction of output tokens the reference would choose.",
                                buckets=AGREEMENT_BUCKETS)
        self.first_divergence = metric(Histogram, "canary_first_divergence_position",
                                       "Output position of the first token the reference disagrees with.",
                                       buckets=POSITION_BUCKETS)
        self.logprob_delta = metric(Histogram, "canary_logprob_delta",
                                    "Per request: mean log p_ref(reference's choice) - log p_ref(served).",
                                    buckets=LOGPROB_BUCKETS)
        self._thread = threading.Thread(target=self._run, name="slimkv-canary", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def offer(self, prompt: list[int], params: SamplingParams, output: list[int],
              finish_reason: str | None) -> None:
        """Called on the engine thread when a request finishes; never blocks it."""
        if not (params.greedy and params.plain) or finish_reason == "abort" or not output:
            return
        if self._rng.random() >= self.fraction:
            return
        try:
            self._queue.put_nowait((prompt, output))
        except queue.Full:
            self.dropped.inc()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self.compare(*item)
            except RequestError as exc:  # e.g. longer than the canary's pool
                log.info("canary skipped a request: %s", exc)
                self.dropped.inc()
            except Exception:
                log.exception("canary comparison failed")
                self.dropped.inc()

    def compare(self, prompt: list[int], output: list[int]) -> float:
        """Record the agreement of one served request with the reference; returns it."""
        logits = self.engine.score(prompt + output)[len(prompt) - 1:-1]
        logp = logits.log_softmax(-1)
        served = torch.tensor(output)
        choice = logp.argmax(-1)
        positions = torch.arange(len(output))
        agree = choice == served
        agreement = agree.float().mean().item()
        self.requests.inc()
        self.agreement.observe(agreement)
        self.logprob_delta.observe(
            (logp[positions, choice] - logp[positions, served]).mean().item())
        if not agree.all():
            self.diverged.inc()
            self.first_divergence.observe(int((~agree).nonzero()[0]))
        return agreement
