"""Build a C kernel of this package on first use and load it through ctypes.

Each source is compiled once per source text / compiler / CPU into ``$SLIMKV_KERNEL_DIR``
(default ``~/.cache/slimkv/kernels``) with ``-march=native`` and OpenMP (the OpenMP runtime
is the one torch already loaded, so kernels share torch's threads). :func:`load` returns the
library, or a sentence saying why there is none (no compiler, a failed build); callers then
take their torch path and say so, never silently.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")

KERNEL_DIR_ENV = "SLIMKV_KERNEL_DIR"
# Reassociation lets dot products and sums vectorise as trees; no finite-math assumptions.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-strict-aliasing",
         "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-shared", "-fPIC",
         "-std=gnu11")


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")


def _library_path(source: Path, cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line for line in cpu.splitlines() if line.startswith("flags")), "")
    headers = "".join(h.read_text() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256("\0".join((source.read_text(), headers, " ".join(FLAGS), version, flags))
                         .encode()).hexdigest()[:16]
    root = Path(os.environ.get(KERNEL_DIR_ENV) or Path.home() / ".cache/slimkv/kernels")
    return root / f"{source.stem}-{key}.so"


@cache
def load(source: Path) -> ctypes.CDLL | str:
    """The compiled ``source`` (a C file next to this module), or why it cannot be had."""
    cc = compiler()
    if cc is None:
        return f"no C compiler ($CC, cc or gcc) found to build slimkv/kernels/{source.name}"
    lib = _library_path(source, cc)
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            built = Path(tmp) / lib.name
            result = subprocess.run([cc, *FLAGS, str(source), "-o", str(built), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode:
                return f"building {source.name} failed: {result.stderr.strip()[-500:]}"
            built.replace(lib)  # atomic: concurrent builders never load a partial file
    return ctypes.CDLL(str(lib))


def signature(fn: Any, argtypes: list, restype: Any = None) -> Any:
    """``fn``, a function of a loaded library, with its ctypes argument and result types."""
    fn.argtypes, fn.restype = argtypes, restype
    return fn


class Kernel(Generic[T]):
    """A C source's ctypes wrapper ``wrap(library)``, built and loaded on first use:
    :meth:`get` (None where it cannot be had) and :meth:`reason` (why not, else None)."""

    def __init__(self, source: Path, wrap: Callable[[ctypes.CDLL], T]) -> None:
        self.source, self.wrap = source, wrap
        self._loaded: T | str | None = None

    def _load(self) -> T | str:
        if self._loaded is None:
            lib = load(self.source)
            self._loaded = lib if isinstance(lib, str) else self.wrap(lib)
        return self._loaded

    def get(self) -> T | None:
        loaded = self._load()
        return None if isinstance(loaded, str) else loaded

    def reason(self) -> str | None:
        loaded = self._load()
        return loaded if isinstance(loaded, str) else None

    def reset(self) -> None:
        """Forget the loaded kernel (tests that change the environment's compiler)."""
        self._loaded = None
