"""Triton GPU kernels over the paged KV pool, reading and writing quantized pages in place.

``side`` describes one layer's K or V pool for the kernels (:class:`side.TritonSide`, made by
:func:`side.describe` from :func:`slimkv.kernels.kernel_format`, the one format mapping
shared with the C kernel); ``decode`` attends single-token queries over the pool
(split-K flash-decoding, :class:`decode.TritonDecode`, the C kernel's call signature);
``write`` quantizes and scatters a step's K/V rows into the pool and stores filled staged
blocks (:func:`write.write_tokens`, :func:`write.store_blocks`). The kernels run on the
tensors' device (CUDA), or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
how the tests run them). Importing ``decode``/``write`` needs the ``triton`` package (pinned
by scripts/setup.sh); this module does not.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (default: CUDA), or None when they can:
    ``triton`` not installed, or no CUDA device and not ``TRITON_INTERPRET=1`` (the
    interpreter runs them on CPU tensors, slowly: tests only)."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (scripts/setup.sh pins it)"
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    kind = torch.device(device).type if device is not None else "cuda"
    if interpret:
        return None if kind == "cpu" else \
            f"TRITON_INTERPRET=1 runs the kernels on CPU tensors only, not on {kind}"
    if kind != "cuda":
        return f"the Triton kernels need a CUDA device (got {kind}; TRITON_INTERPRET=1 on CPU)"
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    return None
