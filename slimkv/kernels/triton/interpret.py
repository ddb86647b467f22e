"""Triton 3.6's interpreter (the GPU image's Triton, run on CPU tensors by the tests and
``scripts/cuda_check.sh --dry-run``) with loops over runtime bounds, as 3.7+ runs them.

The interpreter holds every scalar as a numpy array of shape ``[1]``; a loop such as
``for j in range(start, end)`` asks it for ``int(array)``, which numpy >= 2.4 refuses for
arrays of one dimension ("only 0-dimensional arrays can be converted to Python scalars").
Triton 3.7+ squeezes the array first. Compiled kernels never take this path (the loop is
``scf.for`` over i32 values), so nothing changes on a GPU: :func:`fix_loop_bounds` swaps
that one conversion, only while ``TRITON_INTERPRET=1`` and only in an interpreter that lacks
the squeeze.
"""

from __future__ import annotations

import inspect
import os


def fix_loop_bounds() -> bool:
    """Make the interpreter's scalar ``__index__`` squeeze its array (as Triton 3.7+ does);
    True if it patched (idempotent: a second call patches nothing)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "slimkv_squeezes", False):
        return False
    try:
        if "squeeze" in inspect.getsource(original):
            return False  # this Triton already converts shape-[1] scalars
    except (OSError, TypeError):
        pass

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        # The scope restores attributes in reverse order: this one first, then Triton's.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.slimkv_squeezes = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
