"""KV pool tensors on transparent huge pages (CPU, Linux).

A decode step gathers blocks scattered over a pool of hundreds of MiB: on 4 KiB pages
nearly every block it reads costs a TLB miss and a page walk. With THP in ``madvise`` mode
(the common default) the kernel backs a range with 2 MiB pages only where asked, so each
large pool tensor is carved 2 MiB-aligned out of a fresh allocation and advised
``MADV_HUGEPAGE`` before its first touch. Anywhere else (CUDA, non-Linux, fake tensors,
THP off, madvise failing) :func:`filled` is ``torch.full``: same values, ordinary pages.
``AnonHugePages`` in ``/proc/self/smaps_rollup`` shows whether it took.
"""

from __future__ import annotations

import ctypes
import logging
import math
import sys
from functools import cache

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14

log = logging.getLogger(__name__)


@cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge(address: int, nbytes: int) -> bool:
    """``madvise(MADV_HUGEPAGE)`` on the whole 2 MiB pages inside ``[address, +nbytes)``."""
    madvise = _madvise()
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if madvise is None or end <= start:
        return False
    if madvise(start, end - start, MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return False
    return True


def filled(shape: tuple[int, ...], value: float, dtype: torch.dtype,
           device: torch.device) -> Tensor:
    """``torch.full(shape, value)``; on CPU, a tensor of 2 MiB or more starts on a huge-page
    boundary of memory advised ``MADV_HUGEPAGE`` before it is first written."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or _madvise() is None:
        return torch.full(shape, value, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    if type(raw) is not torch.Tensor:  # a fake tensor (memory profiling): no memory to advise
        return torch.full(shape, value, dtype=dtype, device=device)
    address = raw.data_ptr()
    offset = -address % HUGE_PAGE
    advise_huge(address + offset, nbytes)
    return raw[offset:offset + nbytes].view(dtype).view(shape).fill_(value)
