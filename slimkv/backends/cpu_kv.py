"""int8 pool blocks in and out through ``kernels/kv_blocks.c`` (the CPU backend's prefill):
:class:`CpuPoolWriter` quantizes whole blocks into the pool (``PagedKVCache.writer``: a
staged block that filled, a prefill chunk's full blocks) and :meth:`KVBlocks.read`
dequantizes a prefix's blocks into the model dtype, both bit for bit the codecs' (int8
with per-token or per-channel-block key scales). Other formats (fp8, int4, float), fake
tensors (the start-up replay) and dtypes the kernel lacks take the codecs' torch ops;
where the kernel cannot be built (:func:`kv_blocks_unavailable_reason` says why) every
write and read does."""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path

import torch
from torch import Tensor

from slimkv import kernels
from slimkv.kernels import build
from slimkv.kv.block_scales import ChannelBlockCodec
from slimkv.kv.quant import Int8Codec, KVCodec, QuantizedKV

SOURCE = Path(kernels.__file__).with_name("kv_blocks.c")
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_TOKEN, _BLOCK = 1, 2


def int8_mode(codec: KVCodec) -> int | None:
    """The kernel's scale mode for an int8 codec (None: not one the kernel writes)."""
    if isinstance(codec, ChannelBlockCodec) and isinstance(codec.element, Int8Codec):
        return _BLOCK
    return _TOKEN if type(codec) is Int8Codec else None


def _real(x: Tensor) -> bool:
    return type(x) is torch.Tensor and x.device.type == "cpu"


class KVBlocks:
    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        self._quantize = build.signature(lib.quantize_blocks, [ptr, i64, i64, i32, i32, i32,
                                                               i32, i32, ptr, ptr, ptr, i32])
        self._dequantize = build.signature(lib.dequantize_blocks, [ptr, ptr, i32, ptr, i32,
                                                                   i32, i32, i32, ptr, i32])

    def quantize(self, x: Tensor, block_ids: Tensor, pool: QuantizedKV, mode: int) -> bool:
        """Whole blocks ``x [n, bs, H, D]`` (each token's heads contiguous: a chunk's K or V
        as the projection left it) into ``pool`` (one layer's) at ``block_ids``; False
        (nothing written) where the kernel does not take ``x``."""
        n, bs, heads, dim = x.shape
        if not (_real(x) and x.dtype in KINDS and x.stride()[2:] == (dim, 1)):
            return False
        ids = block_ids.to(torch.int64).contiguous()
        self._quantize(x.data_ptr(), x.stride(0), x.stride(1), KINDS[x.dtype], n, bs, heads, dim,
                       ids.data_ptr(), pool.data.data_ptr(), pool.aux["scale"].data_ptr(), mode)
        return True

    def read(self, pool: QuantizedKV, mode: int, block_ids: Tensor, dtype: torch.dtype,
             rows: int) -> Tensor:
        """Blocks ``block_ids [n]`` of one layer's ``pool`` dequantized to ``dtype`` into the
        first ``n * bs`` rows of a new ``[rows, H, D]`` tensor (the rest left unset)."""
        _, bs, heads, dim = pool.data.shape
        out = torch.empty(max(rows, len(block_ids) * bs), heads, dim, dtype=dtype)
        ids = block_ids.to(torch.int64).contiguous()
        self._dequantize(pool.data.data_ptr(), pool.aux["scale"].data_ptr(), mode,
                         ids.data_ptr(), len(ids), bs, heads, dim, out.data_ptr(), KINDS[dtype])
        return out


_KERNEL = build.Kernel(SOURCE, KVBlocks)
kv_blocks_kernel = _KERNEL.get
kv_blocks_unavailable_reason = _KERNEL.reason


class CpuPoolWriter:
    """``PagedKVCache.writer`` of a CPU cache: int8 sides through the kernel, the others
    through their codecs as the cache itself writes them."""

    def __init__(self, cache, kernel: KVBlocks) -> None:
        self._cache = weakref.ref(cache)  # the cache holds its writer: no cycle
        self.kernel = kernel

    def write(self, layer: int, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
        cache = self._cache()
        for side, x in zip(("k", "v"), (k, v)):
            encoded = cache.layer_codecs[layer][side].quantize(x)
            for stored, new in cache._fields(cache.layer_pool(side, layer), encoded):
                stored.flatten(0, 1)[slot_mapping] = new

    def write_blocks(self, layer: int, block_ids: Tensor, k: Tensor, v: Tensor) -> None:
        cache = self._cache()
        for side, x in zip(("k", "v"), (k, v)):
            codec, pool = cache.layer_codecs[layer][side], cache.layer_pool(side, layer)
            mode = int8_mode(codec)
            if mode is None or not self.kernel.quantize(x, block_ids, pool, mode):
                for stored, new in cache._fields(pool, codec.quantize(x)):
                    stored[block_ids] = new
