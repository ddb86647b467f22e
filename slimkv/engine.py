"""The engine: one ``step()`` schedules, runs one batched forward and samples."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass
from typing import Hashable

import torch

from slimkv.attention import AttentionMetadata, PagedAttention
from slimkv.config import Config, ConfigError
from slimkv.kv.block_pool import BlockPool
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.contiguous import ContiguousKVManager
from slimkv.kv.manager import KVCacheManager
from slimkv.kv.staging import Staging
from slimkv.model import load_model
from slimkv.outputs import Detokenizer, RequestOutput
from slimkv.profiler import activation_peak, weight_bytes
from slimkv.sampling import Sampler, SamplingParams
from slimkv.scheduler import Scheduler
from slimkv.sequence import Sequence, SequenceStatus

GiB = 1 << 30


class RequestError(ValueError):
    """A request the engine cannot serve as asked (too long, empty...)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


_CPU_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``model.dtype``; ``auto`` is bfloat16 where its matmuls are native (CUDA with bf16,
    CPUs with AVX512-BF16 or AMX: half the weight bytes per decode step), else float32."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported()
    else:
        native = bool(_CPU_BF16_FLAGS & _cpu_flags())
    return torch.bfloat16 if native else torch.float32


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


@dataclass(slots=True)
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]            # hidden-state row of each sequence that samples
    sample_seqs: list[Sequence]


class LLMEngine:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        model_dtype = str(self.dtype).removeprefix("torch.")
        self.model_args, self.model, self.tokenizer = load_model(
            config.model.path, self.dtype, self.device)
        self.model_name = config.model.name or self.tokenizer.name
        args, kv = self.model_args, config.kv_cache
        self.max_model_len = min(config.model.max_model_len or args.max_position_embeddings,
                                 args.max_position_embeddings)
        self.k_dtype = model_dtype if kv.key_dtype == "auto" else kv.key_dtype
        self.v_dtype = model_dtype if kv.value_dtype == "auto" else kv.value_dtype
        shape = dict(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads,
                     head_dim=args.head_dim, k_dtype=self.k_dtype, v_dtype=self.v_dtype,
                     k_scale=kv.k_scale, v_scale=kv.v_scale, layer_dtypes=kv.layer_dtypes)
        self.bytes_per_token = PagedKVCache.bytes_per_token(**shape, block_size=kv.block_size)
        # One staging slot per running sequence, plus one for score().
        num_staging = kv.max_concurrency_soft + 1
        self.cache = PagedKVCache(num_blocks=self._num_blocks(shape, num_staging),
                                  block_size=kv.block_size, device=self.device,
                                  num_staging=num_staging, staging_dtype=self.dtype, **shape)
        num_blocks = self.cache.num_blocks
        self.pool = BlockPool(num_blocks, kv.enable_prefix_caching and kv.paged, kv.evict_policy)
        self.manager = (KVCacheManager(self.pool, kv.block_size, num_staging_slots=num_staging)
                        if kv.paged else
                        ContiguousKVManager(self.pool, kv.block_size, self.max_model_len,
                                            num_staging_slots=num_staging))
        self.scheduler = Scheduler(kv, config.scheduler, self.manager)
        self.attention = PagedAttention(self.cache, args.num_heads, args.head_dim ** -0.5,
                                        self.dtype)
        if kv.strict and self.attention.fallback_reason:
            raise ConfigError(
                f"kv_cache.strict: the {self.k_dtype}/{self.v_dtype} KV cache cannot run its "
                f"quantized attention path on {self.device}: {self.attention.fallback_reason} "
                "(set kv_cache.strict: false to serve on the reference path anyway)")
        self.activation_bytes = activation_peak(
            args, self.dtype, self.device, k_dtype=self.k_dtype, v_dtype=self.v_dtype,
            block_size=kv.block_size, num_tokens=config.scheduler.max_num_batched_tokens,
            num_logit_rows=kv.max_concurrency_soft, max_len=self.max_model_len)
        self.sampler = Sampler()
        self.detokenizer = Detokenizer(self.tokenizer)
        self.requests: dict[str, Sequence] = {}
        self.num_steps = 0
        self.finished_reasons: Counter[str] = Counter()
        self._ids = itertools.count()

    def _num_blocks(self, shape: dict, num_staging: int) -> int:
        """``kv_cache.num_blocks``, or what ``memory_gb`` holds once staging is set aside."""
        kv = self.config.kv_cache
        if kv.num_blocks:
            return kv.num_blocks
        staged = PagedKVCache.is_staged(shape["k_dtype"], shape["v_dtype"], shape["head_dim"],
                                        kv.k_scale, kv.v_scale, kv.layer_dtypes)
        staging = Staging.bytes(shape["num_layers"], shape["num_kv_heads"], shape["head_dim"],
                                kv.block_size, num_staging, self.dtype) if staged else 0
        num_blocks = PagedKVCache.num_blocks_for_budget(
            int(kv.memory_gb * GiB), kv.block_size, **shape, reserved_bytes=staging)
        if num_blocks < 1:
            raise ValueError(f"kv_cache.memory_gb={kv.memory_gb} holds no {kv.block_size}-token block")
        return num_blocks

    # -- requests ----------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None,
                    session_id: Hashable | None = None) -> Sequence:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_request(ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, params, session_id=session_id)
        seq.arrival_step = self.num_steps
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        if any(not 0 <= t < self.model_args.vocab_size for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {self.model_args.vocab_size})")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request needs {total} ({len(ids)} in the prompt, {params.max_tokens} to generate)")
        blocks = self.manager.blocks_for(total)
        if blocks > self.pool.num_blocks:
            raise RequestError(f"the request needs {blocks} KV blocks; the pool has "
                               f"{self.pool.num_blocks}")

    def abort_request(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.is_finished:
            seq.finish_reason = "abort"
            self._finish(seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def memory_split(self) -> dict[str, int]:
        """Bytes of the weights, the KV pool, its staging blocks, and the activation peak of
        the largest step
        (measured at start-up, see :mod:`slimkv.profiler`)."""
        return {"weights": weight_bytes(self.model), "kv_cache": self.cache.nbytes,
                "kv_staging": self.cache.staging_nbytes, "activations": self.activation_bytes}

    # -- the step ----------------------------------------------------------------------

    @torch.inference_mode()
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
        batch = self._prepare(sched.scheduled)
        hidden = self._forward(batch)
        tokens: list[int] = []
        if batch.sample_rows:
            logits = self.model.compute_logits(hidden[batch.sample_rows])
            tokens = self.sampler(logits, [s.params for s in batch.sample_seqs],
                                  [s.generator for s in batch.sample_seqs])
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            self.manager.cache_full_blocks(seq)
        return [self._append_token(seq, tok) for seq, tok in zip(batch.sample_seqs, tokens)]

    @torch.inference_mode()
    def score(self, token_ids: list[int], chunk: int | None = None) -> torch.Tensor:
        """Teacher-forced logits [len, vocab] at every position of ``token_ids``, through the
        same paged, quantized cache as serving (in chunks of the step budget; nothing is
        left in the prefix cache). For perplexity and accuracy evaluation."""
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
                logits.append(self.model.compute_logits(self._forward(self._prepare([(seq, n)]))))
                seq.num_computed_tokens += n
        finally:
            self.manager.free(seq)
        return torch.cat(logits)

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        return self.model(batch.input_ids, batch.positions,
                          lambda layer, q, k, v: self.attention(layer, q, k, v, batch.meta))

    def _prepare(self, scheduled: list[tuple[Sequence, int]]) -> StepBatch:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, query_lens, seq_lens, tables, staging = [0], [], [], [], []
        sample_rows, sample_seqs = [], []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            slots += self.manager.slots(seq, start, start + n)
            starts.append(starts[-1] + n)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append([b.block_id for b in seq.blocks])
            staging.append(self.manager.staging_slot(seq))
            if start + n == seq.num_tokens:
                sample_rows.append(starts[-1] - 1)
                sample_seqs.append(seq)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=starts, query_lens=query_lens, seq_lens=seq_lens,
            block_tables=table.to(dev),
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            staging_slots=torch.tensor(staging, dtype=torch.long, device=dev))
        return StepBatch(torch.tensor(ids, dtype=torch.long, device=dev),
                         torch.tensor(positions, dtype=torch.long, device=dev),
                         meta, sample_rows, sample_seqs)

    def _append_token(self, seq: Sequence, token: int) -> RequestOutput:
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
            request_id=seq.request_id, new_token_ids=[token], new_text=new_text,
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
