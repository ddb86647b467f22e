"""KV pool allocation on transparent huge pages (slimkv.kv.hugepages)."""

import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from slimkv.kv.hugepages import HUGE_PAGE, filled

DTYPES = [torch.int8, torch.uint8, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 7), (4, 512, 16, 3, 64)])
def test_filled_matches_torch_full(dtype, shape):
    for value in (0, 1):
        out = filled(shape, value, dtype, torch.device("cpu"))
        expected = torch.full(shape, value, dtype=dtype)
        assert out.shape == expected.shape and out.dtype == dtype and out.is_contiguous()
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux only")
def test_large_tensor_starts_on_a_huge_page():
    out = filled((4, 512, 16, 3, 64), 0, torch.int8, torch.device("cpu"))
    assert out.data_ptr() % HUGE_PAGE == 0


def test_fake_tensors_allocate_nothing():
    with FakeTensorMode():
        out = filled((4, 512, 16, 3, 64), 1, torch.float16, torch.device("cpu"))
    assert out.shape == (4, 512, 16, 3, 64) and out.dtype == torch.float16
