"""The compiled Triton kernels compile no new variant once warm when the integers that change
step to step change (table width, split sizes, sequence and chunk lengths, staged tokens):
those arguments are ``do_not_specialize``, so a timed decode window on a warm GPU holds no
compile. CUDA only (scripts/cuda_check.sh runs it in its process with tests/test_cuda.py);
the interpreter compiles nothing."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                 reason="TRITON_INTERPRET=1 here: nothing is compiled")]

BS, H, G, D = 16, 2, 4, 64


def variants(kernel) -> int:
    """Compiled variants of a jit function, over every device (``device_caches[device][0]``
    is the kernel cache in Triton 3.6 through 3.9)."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


def test_decode_compiles_once_for_every_table_and_split() -> None:
    from slimkv.kernels.triton import decode
    from slimkv.kernels.triton.side import describe
    from slimkv.kv.cache import PagedKVCache

    cache = PagedKVCache(num_layers=1, num_blocks=64, block_size=BS, num_kv_heads=H,
                         head_dim=D, k_dtype="int8", v_dtype="int8", k_scale="per_token",
                         device=torch.device("cuda"))
    sides = [describe(cache.layer_codecs[0][s], cache.layer_pool(s, 0)) for s in "kv"]
    gen = torch.Generator().manual_seed(0)

    def run(batch: int, width: int, per: int) -> None:
        lens = torch.randint(1, width * BS + 1, (batch,), generator=gen)
        lens[0] = 1  # a lone token ("== 1" would be specialized)
        tables = torch.randint(1, 64, (batch, width), generator=gen)
        q = torch.randn(batch, H * G, D, generator=gen)
        decode.TritonDecode(blocks_per_split=per)(
            q.cuda(), tables.cuda(), lens.cuda(), *sides, H, BS, D ** -0.5, None)

    run(3, 20, 4)  # 5 splits: warm (S_PAD 8, a constexpr, stays)
    before = variants(decode._decode_split), variants(decode._merge_splits)
    for batch, width, per in [(4, 16, 3), (5, 17, 3), (2, 32, 5), (7, 33, 6), (1, 40, 8)]:
        run(batch, width, per)
    torch.cuda.synchronize()
    assert (variants(decode._decode_split), variants(decode._merge_splits)) == before


def test_prefill_compiles_once_for_every_length() -> None:
    from slimkv.kernels.triton import prefill
    from slimkv.kernels.triton.side import describe
    from slimkv.kv.cache import PagedKVCache
    from slimkv.kv.staging import Staging

    cache = PagedKVCache(num_layers=1, num_blocks=64, block_size=BS, num_kv_heads=H,
                         head_dim=D, k_dtype="int8", v_dtype="int8",
                         k_scale="per_channel_block", device=torch.device("cuda"))
    sides = [describe(cache.layer_codecs[0][s], cache.layer_pool(s, 0)) for s in "kv"]
    staging = Staging(cache, 1, torch.float32)
    table = torch.arange(1, 64, device="cuda")

    def run(start: int, n: int) -> None:
        kv = torch.randn(2, n, H, D, device="cuda")
        staged = staging.append(0, 0, start, table[start // BS:], *kv)
        q = torch.randn(n, H * G, D, device="cuda")
        prefill.paged_prefill(q, table, start + n, *sides, staged, block_rows=64)

    run(0, 40)  # n * G >= 64: 64-row tiles (ROWS, a constexpr) throughout
    before = variants(prefill._prefill)
    for start, n in [(16, 17), (32, 32), (48, 100), (160, 33), (0, 16)]:
        run(start, n)
    torch.cuda.synchronize()
    assert variants(prefill._prefill) == before
