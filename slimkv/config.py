"""One YAML file configures the whole engine: every section is a slotted dataclass validated
in ``__post_init__``; ``Config.from_dict`` rejects unknown keys naming the full key path, so a
typo never silently falls back to a default (as vLLM's ignored ``kv_cache_dtype`` once did)."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
# model.weights auto: the file's 4/8-bit class where the CPU kernel runs (model_io/weights.py).
WEIGHT_CLASSES = ("auto", "float32", "bfloat16", "int8", "int4")
KV_DTYPES = ("auto", "float32", "float16", "bfloat16",
             "int8", "fp8", "fp8_e4m3", "fp8_e5m2", "int4")
# kv_cache.layer_dtypes names concrete formats only.
LAYER_KV_DTYPES = tuple(d for d in KV_DTYPES if d != "auto")
# Key scale layouts (float dtypes ignore them); values are always scaled per token-head
# (int4: per group of 32). See slimkv/kv/layers.py.
K_SCALES = ("per_token", "per_channel_block")
# Chosen by the eval harness: see docs/kv-formats.md.
DEFAULT_K_SCALE = "per_channel_block"
# kv_cache.int4.group_size: channels per scale and zero of per-token int4 (head_dim 64:
# 5.0 bits per element at 32, 4.5 at 64); the one default every layer of the code uses.
INT4_GROUP_SIZES, INT4_GROUP = (16, 32, 64), 32
# Keys that were removed, with what to do instead: an old config fails naming them.
REMOVED_KEYS = {"kv_cache.v_scale": "values are always scaled per token-head (int4: per group "
                                    "of 32); the key never changed anything, delete it"}
EVICT_POLICIES = ("lru_block", "fifo")
SCHEDULER_POLICIES = ("weighted", "fcfs")
DEFAULT_CONFIG_PATH = Path(__file__).parent / "configs" / "default.yaml"


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the key."""


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _check_choice(value: Any, choices: tuple[str, ...], key: str, *,
                  optional: bool = False) -> None:
    if not (optional and value is None):
        _check(value in choices, key,
               f"unknown value {value!r}; choose one of {', '.join(map(str, choices))}")


def _check_int(value: Any, key: str, low: int = 1, *, optional: bool = False) -> None:
    """An integer >= ``low`` (or None when ``optional``)."""
    if not (optional and value is None):
        _check(isinstance(value, int) and not isinstance(value, bool) and value >= low, key,
               f"must be an integer >= {low}, got {value!r}")


def _check_positive(value: Any, key: str, *, low: float = 0, inclusive: bool = False,
                    optional: bool = False) -> None:
    """A number > ``low`` (>= with ``inclusive``; None allowed when ``optional``)."""
    if not (optional and value is None):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _check(ok and (value >= low if inclusive else value > low), key,
               f"must be a number {'>=' if inclusive else '>'} {low}, got {value!r}")


def _check_fraction(value: float, key: str, *, allow_zero: bool = False) -> None:
    _check_positive(value, key, inclusive=allow_zero)  # a number first: "0.5" is a str
    _check(value <= 1, key, f"must be at most 1, got {value!r}")


@dataclass(slots=True)
class ModelConfig:
    """Which model to serve. ``path`` None means the embedded SmolLM2-135M-Instruct GGUF."""

    path: str | None = None
    dtype: str = "auto"
    weights: str = "auto"  # float32 / bfloat16: unquantized; int8 / int4: grouped by 32
    activations: str = "precise"  # quantized weights' kernel: precise (int8 + residual) | int8
    device: str = "auto"
    max_model_len: int | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        _check_choice(self.dtype, MODEL_DTYPES, "model.dtype")
        _check_choice(self.weights, WEIGHT_CLASSES, "model.weights")
        _check_choice(self.activations, ("precise", "int8"), "model.activations")
        _check(self.weights in ("auto", "int8", "int4") or self.dtype in ("auto", self.weights),
               "model.weights", f"{self.weights} weights need model.dtype {self.weights} or auto")
        _check(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"),
               "model.device", f"expected auto, cpu, cuda or cuda:N, got {self.device!r}")
        _check_int(self.max_model_len, "model.max_model_len", optional=True)


@dataclass(slots=True)
class Int4Config:
    """``kv_cache.int4``: options of the int4 format (issue 46, docs/kv-formats.md), for the
    layers whose K (``rotate_k``) or V (``rotate_v``) is int4; other layers ignore them.
    ``group_size``: channels per scale and zero of per-token int4 (values; keys with
    ``k_scale: per_token``). ``rotate_k``/``rotate_v``: an orthonormal Hadamard on K and Q
    after RoPE / on V and the attention output, which spreads channel outliers.
    ``sink_block``: keep each sequence's first block at the model dtype ("The sink block");
    null: on but with ``kv_cache.offload``, which does not store it."""

    group_size: int = INT4_GROUP
    rotate_k: bool = False
    rotate_v: bool = False
    sink_block: bool | None = None

    def __post_init__(self) -> None:
        _check_choice(self.group_size, INT4_GROUP_SIZES, "kv_cache.int4.group_size")
        for key in ("rotate_k", "rotate_v"):
            _check(isinstance(getattr(self, key), bool), f"kv_cache.int4.{key}",
                   "must be true or false")
        _check(isinstance(self.sink_block, (bool, type(None))), "kv_cache.int4.sink_block",
               "must be true, false or null")


@dataclass(slots=True)
class KVCacheConfig:
    """The paged KV pool: its size, element formats and eviction policy."""

    dtype: str = "int8"
    k_dtype: str | None = None
    v_dtype: str | None = None
    k_scale: str = DEFAULT_K_SCALE
    paged: bool = True
    block_size: int = 16
    memory_gb: float | None = 1.0
    num_blocks: int | None = None
    memory_fraction: float = 0.9  # with memory_gb and num_blocks unset, on CUDA
    max_concurrency_soft: int = 48
    evict_policy: str = "lru_block"
    enable_prefix_caching: bool = True
    watermark: float = 0.7
    watermark_hysteresis: float = 0.05
    strict: bool = True
    layer_dtypes: dict[str, list[int]] | None = None
    offload: dict[str, Any] | None = None  # the tier below the pool: kv/offload/config.py
    session_ttl_s: float = 600.0
    int4: Int4Config = field(default_factory=Int4Config)

    def __post_init__(self) -> None:
        if isinstance(self.int4, dict):  # from YAML
            _reject_unknown(self.int4, Int4Config.__slots__, "kv_cache.int4.")
            self.int4 = Int4Config(**self.int4)
        _check_choice(self.dtype, KV_DTYPES, "kv_cache.dtype")
        for key in ("k_dtype", "v_dtype"):
            _check_choice(getattr(self, key), KV_DTYPES, f"kv_cache.{key}", optional=True)
        _check_choice(self.k_scale, K_SCALES, "kv_cache.k_scale")
        _check(isinstance(self.paged, bool), "kv_cache.paged", "must be true or false")
        _check(isinstance(self.block_size, int) and 1 <= self.block_size <= 256
               and self.block_size & (self.block_size - 1) == 0,
               "kv_cache.block_size", f"must be a power of two in [1, 256], got {self.block_size!r}")
        _check_int(self.num_blocks, "kv_cache.num_blocks", optional=True)
        if self.num_blocks is None and self.memory_gb is not None:
            _check_positive(self.memory_gb, "kv_cache.memory_gb")
        _check_fraction(self.memory_fraction, "kv_cache.memory_fraction")
        _check_int(self.max_concurrency_soft, "kv_cache.max_concurrency_soft")
        _check_choice(self.evict_policy, EVICT_POLICIES, "kv_cache.evict_policy")
        _check_fraction(self.watermark, "kv_cache.watermark")
        _check_fraction(self.watermark_hysteresis, "kv_cache.watermark_hysteresis", allow_zero=True)
        if self.layer_dtypes is not None:
            _check_layer_dtypes(self.layer_dtypes)
        _check_positive(self.session_ttl_s, "kv_cache.session_ttl_s")


def _check_layer_dtypes(value: Any) -> None:
    """``{dtype: [layer, ...]}``, each layer once (counts are checked when the engine starts)."""
    key = "kv_cache.layer_dtypes"
    _check(isinstance(value, dict), key,
           f"must map a KV dtype to a list of layer indices, e.g. {{int8: [0, 1]}}, got {value!r}")
    seen: dict[int, str] = {}
    for dtype, layers in value.items():
        _check_choice(dtype, LAYER_KV_DTYPES, key)
        _check(isinstance(layers, list) and bool(layers), f"{key}.{dtype}",
               f"must be a non-empty list of layer indices, got {layers!r}")
        for layer in layers:
            _check(isinstance(layer, int) and not isinstance(layer, bool) and layer >= 0,
                   f"{key}.{dtype}", f"layer indices are integers >= 0, got {layer!r}")
            _check(layer not in seen, f"{key}.{dtype}",
                   f"layer {layer} is also listed under {seen.get(layer)}")
            seen[layer] = dtype


@dataclass(slots=True)
class SchedulerConfig:
    """Per-step token budget and admission policy."""

    policy: str = "weighted"
    max_num_batched_tokens: int = 512
    long_request_blocks: int = 64
    slow_lane_block_share: float = 0.5
    slow_lane_token_share: float = 0.5
    max_queue: int | None = None
    queue_timeout_s: float | None = None

    def __post_init__(self) -> None:
        _check_choice(self.policy, SCHEDULER_POLICIES, "scheduler.policy")
        _check_int(self.max_num_batched_tokens, "scheduler.max_num_batched_tokens")
        _check_int(self.long_request_blocks, "scheduler.long_request_blocks")
        _check_fraction(self.slow_lane_block_share, "scheduler.slow_lane_block_share")
        _check_fraction(self.slow_lane_token_share, "scheduler.slow_lane_token_share")
        _check_int(self.max_queue, "scheduler.max_queue", 0, optional=True)
        _check_positive(self.queue_timeout_s, "scheduler.queue_timeout_s", optional=True)


# The tools' sections (``server``, ``canary``: slimkv/server/config.py; ``cluster``:
# slimkv/cluster/config.py) live with their tools, which register their dataclasses here on
# import (slimkv/__init__.py imports them); the engine never reads them.
TOOL_SECTIONS: dict[str, type] = {}


def _tool_section(name: str) -> Any:
    return field(default_factory=lambda: TOOL_SECTIONS[name]())


@dataclass(slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: Any = _tool_section("server")    # slimkv.server.config.ServerConfig
    canary: Any = _tool_section("canary")    # slimkv.server.config.CanaryConfig
    cluster: Any = _tool_section("cluster")  # slimkv.cluster.config.ClusterConfig

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Config:
        data = data or {}
        _check(isinstance(data, dict), "<root>", "the config must be a mapping of sections")
        _reject_unknown(data, _sections(), "")
        sections = {}
        for name, section_cls in _sections().items():
            values = data.get(name) or {}
            _check(isinstance(values, dict), name, "must be a mapping")
            known = {f.name for f in dataclasses.fields(section_cls)}
            _reject_unknown(values, known, f"{name}.")
            sections[name] = section_cls(**values)
        return cls(**sections)

    @classmethod
    def load(cls, path: str | Path | None = None) -> Config:
        """Load a YAML file; ``None`` loads the embedded default config."""
        path = Path(path) if path is not None else DEFAULT_CONFIG_PATH
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        return cls.from_dict(data)

    def replace(self, section: str, **changes: Any) -> Config:
        """A copy with some keys of one section changed (validated again)."""
        sections = {name: getattr(self, name) for name in _sections()}
        sections[section] = dataclasses.replace(sections[section], **changes)
        return Config(**sections)

    def to_dict(self) -> dict[str, Any]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in _sections()}


def _sections() -> dict[str, type]:
    """The YAML's sections: each field of Config, by name, and its dataclass."""
    return {f.name: TOOL_SECTIONS.get(f.name, f.default_factory)
            for f in dataclasses.fields(Config)}


def _reject_unknown(values: dict[str, Any], known: Any, prefix: str) -> None:
    for key in values:
        if f"{prefix}{key}" in REMOVED_KEYS:
            raise ConfigError(f"{prefix}{key}: removed: {REMOVED_KEYS[f'{prefix}{key}']}")
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(f"{prefix}{key}: unknown key{hint}")
