"""What slimkv derives from a model file and keeps between processes, so that an engine
process does not parse the GGUF file twice on every start (~10 s of a ~17 s server start on
two cores): the file's metadata and tensor table (:func:`read_gguf`) and its tokenizer's
conversion (:meth:`slimkv.model_io.tokenizer.Tokenizer.from_gguf`).

Each entry is keyed by the file (real path, size, mtime) and the versions of the libraries
that derived it (:func:`cache_path`), is kept only once checked against what it replaces,
and is written under a temporary name and renamed, so a reader never sees half of one. A
cache that cannot be written only means deriving again next time."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CACHE_DIR_ENV = "SLIMKV_MODEL_CACHE_DIR"
_log = logging.getLogger(__name__)


def cache_path(model_file: str, kind: str, *versions: str) -> Path:
    """``$SLIMKV_MODEL_CACHE_DIR/<stem>-<key>.<kind>`` (default ``~/.cache/slimkv/models``):
    a changed file or library version gives a new key."""
    stat = os.stat(model_file)
    key = hashlib.sha256("\0".join((os.path.realpath(model_file), str(stat.st_size),
                                    str(stat.st_mtime_ns), *versions)).encode()).hexdigest()
    root = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache/slimkv/models"
    return Path(root) / f"{Path(model_file).stem}-{key[:16]}.{kind}"


def publish(tmp: str, final: Path) -> None:
    """Rename ``tmp`` (a file or folder next to ``final``) into place; another process that
    got there first wins."""
    try:
        os.rename(tmp, final)
    except OSError as exc:
        _log.info("not cached as %s: %s", final, exc)
        if os.path.isfile(tmp):
            os.remove(tmp)


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    type: Any                  # gguf.GGMLQuantizationType
    data: np.ndarray           # a view of the mapped file, as GGUFReader shapes it


def read_gguf(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """The file's scalar metadata (arrays, i.e. the vocabulary, left out) and its tensors.
    GGUFReader parses every field, ~5 s for a 49K-token vocabulary; its answer is kept as
    JSON (offsets, dtypes, shapes) and later the tensors are mapped from that alone."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

    index = cache_path(path, "gguf.json", importlib.metadata.version("gguf"))
    if index.is_file():
        table = json.loads(index.read_text())
        return table["meta"], _mapped(path, table["tensors"], GGMLQuantizationType)
    reader = GGUFReader(path)
    meta = {}
    for name, field in reader.fields.items():
        if field.types and field.types[0] != GGUFValueType.ARRAY:
            try:
                meta[name] = field.contents()
            except UnicodeDecodeError:  # a string slimkv never reads; do not fail on it
                _log.info("%s: metadata %s is not UTF-8; left out", path, name)
    tensors = [GGUFTensor(t.name, t.tensor_type, t.data) for t in reader.tensors]
    rows = [{"name": t.name, "type": int(t.tensor_type), "offset": int(t.data_offset),
             "dtype": t.data.dtype.str, "shape": list(t.data.shape)} for t in reader.tensors]
    mapped = _mapped(path, rows, GGMLQuantizationType)
    if all(a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
           for a, b in zip(tensors, mapped)):
        try:
            index.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=index.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"meta": meta, "tensors": rows}, f)
            publish(tmp, index)
        except OSError as exc:
            _log.info("GGUF index not cached in %s: %s", index.parent, exc)
    return meta, tensors


def _mapped(path: str, rows: list[dict[str, Any]], types: Any) -> list[GGUFTensor]:
    data = np.memmap(path, mode="r")
    out = []
    for row in rows:
        dtype = np.dtype(row["dtype"])
        size = int(np.prod(row["shape"])) * dtype.itemsize
        view = data[row["offset"]:row["offset"] + size].view(dtype).reshape(row["shape"])
        out.append(GGUFTensor(row["name"], types(row["type"]), view))
    return out
