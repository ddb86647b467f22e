"""The disk tier: one file per chunk in a directory, capped in size, least recently used
first out.

A file is ``<key hex>.kv``: a header (magic, key, format digest, CRC-32 of the payload,
payload length) and the payload. It is written under a temporary name and renamed, so a
reader never sees half a file. A file that is truncated, fails its checksum or carries
another key or format is *corrupt*: it is counted, deleted and never served (the caller
recomputes). When the disk is full or unwritable the tier logs once and stops writing;
reads go on. On start the directory is indexed (headers only), so a restarted server, or
another replica sharing the directory, finds the chunks already there; a file another
process wrote later is found on lookup.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict

import torch
from torch import Tensor

log = logging.getLogger(__name__)

MAGIC = b"SLIMKVC1"
HEADER = struct.Struct("<8s16s16sIQ")  # magic, key, format digest, crc32, payload bytes
SUFFIX = ".kv"


class CorruptChunk(Exception):
    """A chunk file that must not be served."""


class DiskTier:
    def __init__(self, path: str, capacity_bytes: int, format_digest: bytes,
                 chunk_bytes: int) -> None:
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.format_digest = format_digest
        self.chunk_bytes = chunk_bytes
        self.file_bytes = HEADER.size + chunk_bytes
        self.writable = True
        self.num_corrupt = 0     # files found corrupt (on start or on load)
        self._index: OrderedDict[bytes, None] = OrderedDict()  # LRU first
        self._lock = threading.Lock()
        os.makedirs(path, exist_ok=True)
        self._scan()

    @property
    def num_bytes(self) -> int:
        return len(self._index) * self.file_bytes

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index or os.path.exists(self._file(key))

    def _file(self, key: bytes) -> str:
        return os.path.join(self.path, key.hex() + SUFFIX)

    # -- start-up ------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the directory's chunk files of this format, oldest first; other formats'
        files are left alone, unreadable ones counted as corrupt and removed."""
        found = []
        for entry in os.scandir(self.path):
            if not entry.name.endswith(SUFFIX) or not entry.is_file():
                continue
            try:
                key = bytes.fromhex(entry.name[:-len(SUFFIX)])
                with open(entry.path, "rb") as f:
                    header = self._parse(f.read(HEADER.size), key, entry.stat().st_size)
            except (ValueError, OSError, CorruptChunk):
                self._discard_corrupt(entry.path)
                continue
            if header is not None:
                found.append((entry.stat().st_mtime, key))
        for _, key in sorted(found):
            self._index[key] = None
        self._shrink(0)

    def _parse(self, raw: bytes, key: bytes, file_size: int) -> int | None:
        """The payload CRC from a header, None for another format's file; raises
        :class:`CorruptChunk` for anything else that is wrong."""
        if len(raw) < HEADER.size:
            raise CorruptChunk("truncated header")
        magic, file_key, digest, crc, size = HEADER.unpack(raw)
        if magic != MAGIC or file_key != key:
            raise CorruptChunk("bad magic or key")
        if digest != self.format_digest:
            return None
        if size != self.chunk_bytes or file_size != HEADER.size + size:
            raise CorruptChunk("wrong size")
        return crc

    # -- reads -----------------------------------------------------------------------------

    def get(self, key: bytes) -> Tensor | None:
        """The chunk's payload, or None when absent or corrupt (then counted and removed)."""
        path = self._file(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            with self._lock:
                self._index.pop(key, None)
            return None
        except OSError:
            return None
        try:
            crc = self._parse(data[:HEADER.size], key, len(data))
            if crc is None or zlib.crc32(memoryview(data)[HEADER.size:]) != crc:
                raise CorruptChunk("checksum mismatch" if crc is not None else "foreign format")
        except CorruptChunk as exc:
            log.warning("offload: skipping chunk file %s (%s)", path, exc)
            self._discard_corrupt(path, key)
            return None
        with self._lock:
            self._index[key] = None
            self._index.move_to_end(key)
        return torch.frombuffer(bytearray(memoryview(data)[HEADER.size:]), dtype=torch.uint8)

    def _discard_corrupt(self, path: str, key: bytes | None = None) -> None:
        with self._lock:
            self.num_corrupt += 1
            if key is not None:
                self._index.pop(key, None)
        try:
            os.unlink(path)
        except OSError:
            pass

    # -- writes ----------------------------------------------------------------------------

    def put(self, key: bytes, payload: Tensor) -> tuple[bool, int]:
        """Store a chunk: ``(stored, files evicted to stay under the cap)``. Not stored when
        one file exceeds the cap or writing failed (after which the tier stops writing)."""
        if key in self._index:
            with self._lock:
                self._index.move_to_end(key)
            return True, 0
        if not self.writable or self.file_bytes > self.capacity_bytes:
            return False, 0
        evicted = self._shrink(self.file_bytes)
        data = payload.numpy().tobytes()
        header = HEADER.pack(MAGIC, key, self.format_digest, zlib.crc32(data), len(data))
        path = self._file(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            self.writable = False
            log.error("offload: cannot write to %s (%s); the disk tier stops writing and "
                      "keeps serving what it holds", self.path, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False, evicted
        with self._lock:
            self._index[key] = None
        return True, evicted

    def _shrink(self, room: int) -> int:
        """Delete least recently used files until ``room`` more bytes fit under the cap."""
        evicted = 0
        while self._index and self.num_bytes + room > self.capacity_bytes:
            with self._lock:
                key, _ = self._index.popitem(last=False)
            try:
                os.unlink(self._file(key))
            except OSError:
                pass
            evicted += 1
        return evicted
