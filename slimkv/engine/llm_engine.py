"""The engine loop: requests in, one ``step()`` at a time, outputs out.

Each step the scheduler picks the sequences to run and gives them blocks (the KV manager),
the model runner runs them in one batched forward and samples, and the engine appends the
sampled tokens, detokenizes and finishes what is done.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import Callable, Hashable

import torch

from slimkv.attention.layer import Kernels
from slimkv.config import Config, ConfigError
from slimkv.engine.engine_stats import BlockInfo, EngineStats, LaneCounts
from slimkv.kv.block_pool import BlockPool
from slimkv.kv.connector import KVConnector
from slimkv.kv.manager import KVCacheManager
from slimkv.model.protocol import ModelLoader
from slimkv.engine.choices import Choices
from slimkv.engine.outputs import Detokenizer, RequestOutput, token_logprobs
from slimkv.engine.runner import ModelRunner
from slimkv.engine.sampling import LogitsProcessor, SampledToken, SamplingParams
from slimkv.engine.scheduler import Scheduler
from slimkv.engine.sequence import Sequence, SequenceStatus


class RequestError(ValueError):
    """A request the engine cannot serve as asked (too long, empty...)."""


class LLMEngine:
    """Plug-ins, from whoever builds the engine (:func:`slimkv.plugins.build_engine`):
    ``loader`` gives it its model and tokenizer (required), ``processors`` makes the
    sampler's logits processors (a request asking for an option none serves is refused),
    ``connector`` the KV store below the pool for ``kv_cache.offload``, ``contiguous`` the
    baseline KV manager for ``kv_cache.paged: false`` (the paged manager's interface),
    ``kernels`` the attention backends over native kernels (else attention runs on SDPA)."""

    def __init__(self, config: Config, loader: ModelLoader | None = None,
                 processors: Callable[[ModelRunner], list[LogitsProcessor]] | None = None,
                 connector: Callable[[ModelRunner], KVConnector] | None = None,
                 contiguous: Callable[..., KVCacheManager] | None = None,
                 kernels: Kernels | None = None) -> None:
        if not config.kv_cache.paged and contiguous is None:
            raise ConfigError("kv_cache.paged: false: this engine was built without the "
                              "contiguous baseline (slimkv.plugins.build_engine adds it)")
        self.config = config
        self.runner = ModelRunner(config, loader, processors, kernels)
        self.model_args, self.tokenizer = self.runner.model_args, self.runner.tokenizer
        self.model_name = config.model.name or self.tokenizer.name
        self.max_model_len = self.runner.max_model_len
        kv = config.kv_cache
        self.pool = BlockPool(self.runner.cache.num_blocks, kv.enable_prefix_caching and kv.paged,
                              kv.evict_policy, self.runner.num_sink)
        self.pool.on_demote = self.runner.cache.copy_block  # a sink's cached content lives on
        opts = dict(session_ttl_s=kv.session_ttl_s,
                    num_staging_slots=self.runner.num_staging_slots)
        self.manager = (KVCacheManager(self.pool, kv.block_size, **opts) if kv.paged else
                        contiguous(self.pool, kv.block_size, self.max_model_len, **opts))
        self.connector = self._connect(connector) if kv.offload is not None else None
        self.scheduler = Scheduler(kv, config.scheduler, self.manager)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.requests: dict[str, Sequence] = {}  # every live sequence, by its own id
        self.choices = Choices()
        self.num_steps = 0
        self.finished_reasons: Counter[str] = Counter()
        self._ids = itertools.count()
        runner = self.runner
        self._facts = dict(model_name=self.model_name, k_dtype=runner.k_dtype,
                           v_dtype=runner.v_dtype, bytes_per_token=runner.bytes_per_token,
                           block_size=kv.block_size, num_blocks=self.pool.num_blocks,
                           memory=runner.memory_split(), watermark=kv.watermark,
                           evict_policy=kv.evict_policy,
                           max_concurrency_soft=kv.max_concurrency_soft)

    def _connect(self, make: Callable[[ModelRunner], KVConnector] | None) -> KVConnector:
        if make is None:
            raise ConfigError("kv_cache.offload: this engine was built without a KV connector "
                              "(slimkv.plugins.build_engine adds the offload tier)")
        connector = make(self.runner)
        connector.attach(self.pool)
        self.manager.connector = connector
        return connector

    # -- requests ----------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None,
                    session_id: Hashable | None = None) -> Sequence:
        """Queue a request; returns its first sequence (``n`` choices: slimkv.engine.choices)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_request(ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.choices:
            raise RequestError(f"request id {request_id!r} is already in use")
        group = [Sequence(request_id, ids, params, session_id=session_id if i == 0 else None,
                          index=i) for i in range(params.n)]
        for seq in group:
            self.runner.sampler.add(seq)
            seq.arrival_step = self.num_steps
            self.requests[seq.request_id] = seq
        self.choices.add(group)
        self.scheduler.add(group[0])
        return group[0]

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        if unserved := params.options - self.runner.sampler.options:
            raise RequestError(f"this engine has no logits processor for {sorted(unserved)} "
                               "(slimkv.plugins.build_engine adds them)")
        if any(not 0 <= t < self.model_args.vocab_size for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {self.model_args.vocab_size})")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request needs {total} ({len(ids)} in the prompt, {params.max_tokens} to generate)")
        blocks = self.manager.max_blocks(total)
        if blocks > self.pool.num_blocks:
            raise RequestError(f"the request needs {blocks} KV blocks; the pool has "
                               f"{self.pool.num_blocks}")

    def abort_request(self, request_id: str) -> None:
        for seq in self.choices.of(request_id):
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._finish(seq)

    def has_request(self, request_id: str) -> bool:
        """Whether some choice of the request is still queued or running."""
        return request_id in self.choices

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def memory_split(self) -> dict[str, int]:
        """Bytes of the weights, the KV pool, its staging blocks and the activation peak
        (see :meth:`ModelRunner.memory_split`)."""
        return dict(self._facts["memory"])

    def unscheduled_since(self, deadline: float) -> list[str]:
        """Ids of waiting requests never scheduled that arrived before ``deadline``
        (``time.monotonic()``)."""
        return list(dict.fromkeys(s.parent_id for s in self.scheduler.waiting
                                  if s.scheduled_time is None and s.arrival_time < deadline))

    # -- what the engine reports ---------------------------------------------------------

    def stats(self) -> EngineStats:
        sched, pool, manager = self.scheduler, self.pool, self.manager
        return EngineStats(
            **self._facts, step=self.num_steps, num_running=sched.num_running(),
            num_waiting=sched.num_waiting(),
            lanes={lane: LaneCounts(sched.num_running(lane), sched.num_waiting(lane))
                   for lane in ("fast", "slow")},
            num_free_blocks=pool.num_free_blocks, watermark_alert=sched.watermark_alert,
            prefix_queries=manager.num_prefix_queries, prefix_hits=manager.num_prefix_hits,
            preemptions=sched.num_preemptions, evictions=pool.num_evictions,
            false_ooms=getattr(manager, "num_false_oom", 0),
            attention_paths=dict(self.runner.attention.path_counts),
            finished=dict(self.finished_reasons), offload=self.connector.stats() if self.connector else {})

    def block_map(self) -> list[BlockInfo]:
        """Every block of the pool, in id order, with its state and holders."""
        holders: dict[int, list[tuple[str, int]]] = {}
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            for index, block in enumerate(seq.blocks):
                holders.setdefault(block.block_id, []).append((seq.request_id, index))
        bs = self.manager.block_size
        staged = {seq.blocks[seq.num_computed_tokens // bs].block_id
                  for seq in self.scheduler.running
                  if seq.staging_slot is not None and seq.num_computed_tokens % bs
                  and len(seq.blocks) > seq.num_computed_tokens // bs}
        return [BlockInfo(b.block_id, "staging" if b.block_id in staged else b.state,
                          b.ref_cnt, tuple(holders.get(b.block_id, ())),
                          None if b.session_head is None else str(b.session_head), b.last_used)
                for b in self.pool.blocks]

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        self.manager.expire_sessions()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        now = time.monotonic()
        for seq, _ in sched.scheduled:
            if seq.scheduled_time is None:
                seq.scheduled_time = now
        sampled = self.runner.execute(sched.scheduled)
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            self.manager.cache_full_blocks(seq)
        for seq in self.choices.ready():
            self.scheduler.add(seq)
        return [self._append_token(seq, token) for seq, token in sampled]

    def score(self, token_ids: list[int], chunk: int | None = None,
              last: int | None = None) -> torch.Tensor:
        """Teacher-forced logits [len, vocab] at every position of ``token_ids``, through the
        same paged, quantized cache as serving (in chunks of the step budget; nothing is
        left in the prefix cache). For perplexity and accuracy evaluation. With ``last``,
        only the last ``last`` positions' logits (the others are prefilled, not projected)."""
        seq = Sequence(f"score-{next(self._ids)}", token_ids, SamplingParams(max_tokens=1))
        self.check_request(token_ids, seq.params)
        chunk = chunk or self.config.scheduler.max_num_batched_tokens
        logits = []
        try:
            while seq.num_uncomputed_tokens:
                n = min(chunk, seq.num_uncomputed_tokens)
                if not self.manager.can_allocate(seq, n):
                    raise RequestError("not enough free KV blocks to score this text now")
                self.manager.allocate(seq, n)
                keep = n if last is None else max(0, min(n, last - seq.num_uncomputed_tokens + n))
                logits.append(self.runner.logits(seq, n, keep))
                seq.num_computed_tokens += n
        finally:
            self.manager.free(seq)
        return torch.cat(logits)

    def _append_token(self, seq: Sequence, sampled: SampledToken) -> RequestOutput:
        token = sampled.token_id
        now = time.monotonic()
        out_ttft = None
        itl = None if seq.last_token_time is None else now - seq.last_token_time
        if seq.first_token_time is None:
            seq.first_token_time = now
            seq.first_token_step = self.num_steps
            out_ttft = now - seq.arrival_time
        seq.last_token_time = now
        seq.token_ids.append(token)
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.eos_token_ids):
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        new_text = self.detokenizer.update(seq)
        if seq.finish_reason is not None:
            self._finish(seq)
        return RequestOutput(
            request_id=seq.parent_id, index=seq.index,
            logprobs=token_logprobs(self.tokenizer, sampled),
            new_token_ids=[token], new_text=new_text,
            finished=seq.is_finished, finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens, text=seq.output_text,
            token_ids=seq.output_token_ids,
            queue_time=(seq.scheduled_time - seq.arrival_time) if out_ttft is not None else None,
            ttft=out_ttft, itl=itl,
            e2e=(now - seq.arrival_time) if seq.is_finished else None)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self.manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        self.finished_reasons[seq.finish_reason] += 1
        del self.requests[seq.request_id]
        self.choices.finished(seq)
