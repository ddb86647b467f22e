"""The paged KV cache: element formats (codecs) and the preallocated pool."""

from slimkv.kv.cache import PagedKVCache
from slimkv.kv.quant import KV_CODEC_NAMES, KVCodec, QuantizedKV, make_codec

__all__ = ["KV_CODEC_NAMES", "KVCodec", "PagedKVCache", "QuantizedKV", "make_codec"]
