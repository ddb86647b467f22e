"""The model runner: the tensor side of a step.

It owns the model, the KV pool, the staging blocks and the attention, and turns the
scheduler's ``(sequence, tokens)`` pairs into one batched forward: ``_prepare`` sends the
step's inputs to the device with its metadata, built once for every layer
(:mod:`slimkv.engine.step_inputs`), ``_forward`` runs the model over the paged cache, and
the sampler picks the next tokens.
Block bookkeeping (which blocks a sequence holds) stays with the engine's KV manager.
"""

from __future__ import annotations

from typing import Callable

import torch

from slimkv.attention.layer import Kernels, PagedAttention
from slimkv.config import Config, ConfigError
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import SINK_SHARE, Staging
from slimkv.engine.memory import activation_peak, device_kv_budget, weight_bytes
from slimkv.model.lean import set_activations
from slimkv.model.protocol import ModelLoader
from slimkv.engine.sampling import LogitsProcessor, SampledToken, Sampler
from slimkv.engine.sequence import Sequence
from slimkv.engine.step_inputs import BlockTables, StepInputs, build_step
from slimkv.stats import cdiv

GiB = 1 << 30
_CPU_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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


def weights_class(model: torch.nn.Module) -> str:
    """What the loaded weights are held in, e.g. ``int4 layers, int8 head`` or ``bfloat16``."""
    head = getattr(model, "lm_head", None)
    layer = model.layers[0].attention.wqkv
    if not hasattr(layer, "bits"):
        return str(layer.weight.dtype).removeprefix("torch.")
    return f"int{layer.bits} layers, {f'int{head.bits}' if head else 'float'} head"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


class ModelRunner:
    """Model, KV pool and attention for one engine; see the module doc."""

    def __init__(self, config: Config, loader: ModelLoader | None,
                 processors: Callable[[ModelRunner], list[LogitsProcessor]] | None = None,
                 kernels: Kernels | None = None) -> None:
        if loader is None:
            raise TypeError("an engine needs a model loader: build it with "
                            "slimkv.plugins.build_engine(config)")
        self.config = config
        self.device = resolve_device(config.model.device)
        weights, dtype = config.model.weights, config.model.dtype
        self.dtype = resolve_dtype(weights if weights in ("float32", "bfloat16") and
                                   dtype == "auto" else dtype, self.device)
        model_dtype = str(self.dtype).removeprefix("torch.")
        self.model_args, self.model, self.tokenizer = loader(config, self.device, self.dtype)
        self.weights_class = weights_class(self.model)
        set_activations(self.model, config.model.activations == "precise")
        args, kv = self.model_args, config.kv_cache
        self.max_model_len = min(config.model.max_model_len or args.max_position_embeddings,
                                 args.max_position_embeddings)
        k_dtype, v_dtype = kv.k_dtype or kv.dtype, kv.v_dtype or kv.dtype
        self.k_dtype = model_dtype if k_dtype == "auto" else k_dtype
        self.v_dtype = model_dtype if v_dtype == "auto" else v_dtype
        shape = dict(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads,
                     head_dim=args.head_dim, k_dtype=self.k_dtype, v_dtype=self.v_dtype,
                     k_scale=kv.k_scale, layer_dtypes=kv.layer_dtypes,
                     int4_group_size=kv.int4.group_size)
        self.bytes_per_token = PagedKVCache.bytes_per_token(**shape, block_size=kv.block_size)
        staged = Staging.needed(self.k_dtype, self.v_dtype, args.head_dim, kv.k_scale,
                                kv.layer_dtypes)
        # One staging slot per running sequence, plus one for score().
        self.num_staging_slots = kv.max_concurrency_soft + 1 if staged else 0
        # kv_cache.int4.sink_block (docs/kv-formats.md): a float block 0 per staging slot,
        # as many again for cached heads, capped in _num_blocks; bytes from the same budget.
        int4 = "int4" in (self.k_dtype, self.v_dtype, *(kv.layer_dtypes or {}))
        sink = kv.offload is None if kv.int4.sink_block is None else kv.int4.sink_block
        self.num_sink = 2 * self.num_staging_slots if int4 and sink and kv.paged else 0
        self.activation_bytes = activation_peak(
            args, self.dtype, self.device, k_dtype=self.k_dtype, v_dtype=self.v_dtype,
            k_scale=kv.k_scale, block_size=kv.block_size,
            num_tokens=config.scheduler.max_num_batched_tokens,
            num_logit_rows=kv.max_concurrency_soft, max_len=self.max_model_len,
            layer_dtypes=kv.layer_dtypes)
        self.cache = PagedKVCache(num_blocks=self._num_blocks(shape), block_size=kv.block_size,
                                  device=self.device, **shape)
        self.staging = (Staging(self.cache, self.num_staging_slots, self.dtype, self.num_sink)
                        if staged else None)
        # V's rotation is free where the loader folded it into dense weights (model_io).
        rotate = (kv.int4.rotate_k, kv.int4.rotate_v and not getattr(self.model, "v_rotated", 0))
        self.attention = PagedAttention(self.cache, args.num_heads, args.head_dim ** -0.5,
                                        self.dtype, staging=self.staging, kernels=kernels,
                                        rotate=rotate)
        if kv.strict and self.attention.backend.fallback_reason:
            raise ConfigError(
                f"kv_cache.strict: the {self.k_dtype}/{self.v_dtype} KV cache cannot run its "
                f"quantized attention path on {self.device}: "
                f"{self.attention.backend.fallback_reason} "
                "(set kv_cache.strict: false to serve on the reference path anyway)")
        # Chosen with the backend: the prefill pieces' mask dtype, planned in each step's
        # metadata for the backends that attend in pieces.
        self.piece_dtype = self.attention.backend.piece_dtype
        self.block_tables = BlockTables(cdiv(self.max_model_len, kv.block_size), self.device,
                                        max(8, self.num_staging_slots))
        self.sampler = Sampler(processors(self) if processors else [])
        # A step of decodes through every layer in one call, where the backend has one.
        self.lean_step = self.attention.backend.one_call_step(self.model, self.attention)

    def _num_blocks(self, shape: dict) -> int:
        """``kv_cache.num_blocks``, or what ``memory_gb`` (unset on CUDA: the share
        ``memory_fraction`` of the device leaves) holds once staging is set aside."""
        kv = self.config.kv_cache
        if kv.num_blocks:  # the sink region's ids after them
            return kv.num_blocks + self.num_sink
        budget = (int(kv.memory_gb * GiB) if kv.memory_gb is not None else
                  device_kv_budget(self.device, kv.memory_fraction, self.activation_bytes))
        dims = (shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], kv.block_size)
        sink = Staging.bytes(*dims, 1, self.dtype) + round(self.bytes_per_token * kv.block_size)
        self.num_sink = min(self.num_sink, budget // SINK_SHARE // sink)
        staging = Staging.bytes(*dims, self.num_staging_slots + self.num_sink, self.dtype)
        num_blocks = PagedKVCache.num_blocks_for_budget(budget, staging, **shape,
                                                        block_size=kv.block_size)
        if num_blocks <= self.num_sink:
            raise ValueError(f"kv_cache.memory_gb={kv.memory_gb} (a budget of {budget} bytes) "
                             f"holds no {kv.block_size}-token block")
        return num_blocks

    def memory_split(self) -> dict[str, int]:
        """Bytes of the weights, the KV pool, its staging blocks, and the activation peak of
        the largest step (measured at start-up, see :func:`slimkv.engine.memory.activation_peak`)."""
        return {"weights": weight_bytes(self.model), "kv_cache": self.cache.nbytes,
                "kv_staging": self.staging.nbytes if self.staging else 0,
                "activations": self.activation_bytes}

    # -- one step ----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]
                ) -> list[tuple[Sequence, SampledToken]]:
        """Run the scheduled tokens; each sequence whose step reaches its last token
        samples one: ``(sequence, token)`` pairs in batch order."""
        step, rows, seqs = self._prepare(scheduled)
        hidden = self._forward(step)
        if not rows:
            return []
        # Every row samples in a step of decodes: no gather (rows only ever increase).
        logits = self.model.compute_logits(hidden if len(rows) == len(hidden) else hidden[rows])
        for seq in seqs:
            self._generator(seq, logits.device)
        return list(zip(seqs, self.sampler(logits, seqs)))

    @staticmethod
    def _generator(seq: Sequence, device: torch.device) -> torch.Generator | None:
        """The seeded request's own generator, made on first use and kept (preemption
        included), so its samples do not depend on the batch it runs in; choice ``i`` of
        ``n`` uses ``seed + i``."""
        if seq.generator is None and seq.params.seed is not None:
            seed = seq.params.seed + seq.index  # each of the n choices draws its own
            seq.generator = torch.Generator(device).manual_seed(seed % 2**64 if seed >= 0 else seed)
        return seq.generator

    @torch.inference_mode()
    def logits(self, seq: Sequence, num_tokens: int, keep: int | None = None) -> torch.Tensor:
        """Logits ``[keep, vocab]`` of the last ``keep`` (default all) of the sequence's next
        ``num_tokens`` tokens (its blocks must already hold room for them): teacher
        forcing, for scoring."""
        step, _, _ = self._prepare([(seq, num_tokens)])
        hidden, keep = self._forward(step), num_tokens if keep is None else keep
        if not keep:
            return hidden.new_empty(0, self.model_args.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[len(hidden) - keep:])

    def _forward(self, step: StepInputs) -> torch.Tensor:
        meta = step.meta
        return self.model(step.ids, step.positions,
                          lambda layer, q, k, v: self.attention(layer, q, k, v, meta),
                          self.lean_step and self.lean_step.bind(meta))

    def _prepare(self, scheduled: list[tuple[Sequence, int]]
                 ) -> tuple[StepInputs, list[int], list[Sequence]]:
        """The step's inputs, and the hidden-state row and sequence of each sampler."""
        rows, seqs, end = [], [], 0
        for seq, n in scheduled:
            end += n
            if seq.num_computed_tokens + n == seq.num_tokens:
                rows.append(end - 1)
                seqs.append(seq)
        step = build_step(self.block_tables, scheduled, self.cache.block_size,
                          self.staging is not None, self.piece_dtype)
        return step, rows, seqs
