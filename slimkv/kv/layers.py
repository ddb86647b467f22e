"""Per-layer KV dtypes (``kv_cache.layer_dtypes``): mixed precision across layers.

Layers differ in how much quantizing their KV costs (``slimkv eval --sensitivity``
measures it), so the most sensitive ones can keep more bits. ``layer_dtypes`` maps a dtype
to the layers that use it for both K and V; every other layer uses the cache's default K
and V dtypes. Key and value scale layouts are the cache's, for every layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from slimkv.config import INT4_GROUP, ConfigError
from slimkv.kv.block_scales import per_channel_block
from slimkv.kv.quant import FloatCodec, KVCodec, make_codec

LayerDtypes = Mapping[str, Sequence[int]]


def side_codec(name: str, head_dim: int, scale: str, group_size: int = INT4_GROUP) -> KVCodec:
    """The codec of ``name`` with a scale layout. ``per_token`` computes scales within each
    token-head vector: one for int8/fp8, one per ``group_size`` channels for int4
    (``kv_cache.int4.group_size``; values always use it). ``per_channel_block`` (keys):
    see :mod:`slimkv.kv.block_scales`. Float dtypes have no scales."""
    codec = make_codec(name, head_dim, group_size)
    if scale == "per_channel_block" and not isinstance(codec, FloatCodec):
        return per_channel_block(codec)
    return codec


def side_codecs(k_dtype: str, v_dtype: str, head_dim: int, k_scale: str,
                group_size: int = INT4_GROUP) -> dict[str, KVCodec]:
    """``{"k": codec, "v": codec}``: keys with the ``k_scale`` layout, values per token."""
    return {"k": side_codec(k_dtype, head_dim, k_scale, group_size),
            "v": make_codec(v_dtype, head_dim, group_size)}


def layer_dtype_names(num_layers: int, k_dtype: str, v_dtype: str,
                      layer_dtypes: LayerDtypes | None) -> list[tuple[str, str]]:
    """``(K dtype, V dtype)`` of every layer."""
    names = [(k_dtype, v_dtype)] * num_layers
    for dtype, layers in (layer_dtypes or {}).items():
        for layer in layers:
            if not 0 <= layer < num_layers:
                raise ConfigError(f"kv_cache.layer_dtypes: {dtype} lists layer {layer}, but the "
                                 f"model has {num_layers} layers (0 to {num_layers - 1})")
            names[layer] = (dtype, dtype)
    return names


def layer_codecs(num_layers: int, head_dim: int, k_dtype: str, v_dtype: str, k_scale: str,
                 layer_dtypes: LayerDtypes | None = None,
                 group_size: int = INT4_GROUP) -> list[dict[str, KVCodec]]:
    """``{"k": codec, "v": codec}`` of every layer (layers with the same dtypes share the
    codec objects); keys with the ``k_scale`` layout, values per token."""
    made: dict[tuple[str, str], dict[str, KVCodec]] = {}
    out = []
    for k, v in layer_dtype_names(num_layers, k_dtype, v_dtype, layer_dtypes):
        codecs = side_codecs(k, v, head_dim, k_scale, group_size)
        # Keyed by canonical names, so aliases (fp8, fp8_e4m3) share one pool too.
        out.append(made.setdefault((codecs["k"].name, codecs["v"].name), codecs))
    return out


def dtype_pairs(k_dtype: str, v_dtype: str,
                layer_dtypes: LayerDtypes | None) -> set[tuple[str, str]]:
    """The ``(K dtype, V dtype)`` pairs a cache may use, without knowing its layer count:
    the defaults and every ``layer_dtypes`` entry."""
    return {(k_dtype, v_dtype), *((dtype, dtype) for dtype in layer_dtypes or {})}
