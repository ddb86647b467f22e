"""The disk tier: one file per chunk in a directory, capped in size, least recently used
first out.

A file is ``<key hex>.kv``: a header (magic, key, format digest, CRC-32 of the payload,
payload length) and the payload. It is written under a temporary name and renamed, so a
reader never sees half a file. A file that is truncated, fails its checksum or carries
another key or format is *corrupt*: it is counted, deleted and never served (the caller
recomputes). When the disk is full or unwritable the tier logs once and stops writing;
reads go on. On start the directory is indexed (headers only), so a restarted server, or
another replica sharing the directory, finds the chunks already there.

**A shared directory.** Lookups never depend on this process's index: a chunk is found by
its file name (the key, the chained hash of its last block under the KV format), so a file
another process wrote is found on lookup. A chunk already on disk is not written again;
temporary files name their host and process, and one left by a process that died
mid-write (``kill -9``) is removed at the next start (any left older than
``STALE_TMP_S``). The size cap counts every file in the directory: the index adopts other
processes' files (and forgets deleted ones) every ``REFRESH_S`` while writing, so the
least recently used file goes first whoever wrote it. A crash never leaves a truncated
``.kv`` file (rename is atomic); a torn one after a power loss fails its checksum.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import zlib
from collections import OrderedDict

import torch
from torch import Tensor

log = logging.getLogger(__name__)

MAGIC = b"SLIMKVC1"
HEADER = struct.Struct("<8s16s16sIQ")  # magic, key, format digest, crc32, payload bytes
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 600.0   # a temporary file this old is a dead writer's, on any host
REFRESH_S = 5.0       # adopt other processes' files into the index this often (writes)
HOST = socket.gethostname().replace(".", "_") or "host"


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
        self.num_stale_tmp = 0   # dead writers' temporary files removed on start
        self._refreshed = time.monotonic()
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
            if entry.name.endswith(TMP_SUFFIX) and _stale_tmp(entry):
                try:
                    os.unlink(entry.path)
                    self.num_stale_tmp += 1
                except OSError:
                    pass
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
        path = self._file(key)
        if os.path.exists(path):          # another process sharing the directory wrote it
            with self._lock:
                self._index[key] = None
            return True, 0
        if time.monotonic() - self._refreshed > REFRESH_S:
            self._refresh()
        evicted = self._shrink(self.file_bytes)
        data = payload.numpy().tobytes()
        header = HEADER.pack(MAGIC, key, self.format_digest, zlib.crc32(data), len(data))
        tmp = f"{path}.{HOST}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
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

    def _refresh(self) -> None:
        """Adopt the chunk files other processes wrote since (as recently used) and forget
        the ones they deleted, so the cap holds for the directory as a whole."""
        self._refreshed = time.monotonic()
        try:
            keys = {bytes.fromhex(e.name[:-len(SUFFIX)]) for e in os.scandir(self.path)
                    if e.name.endswith(SUFFIX) and len(e.name) == 32 + len(SUFFIX)}
        except (OSError, ValueError):
            return
        with self._lock:
            for key in [k for k in self._index if k not in keys]:
                del self._index[key]
            new = keys.difference(self._index)
        for key in new:
            try:
                with open(self._file(key), "rb") as f:
                    mine = self._parse(f.read(HEADER.size), key,
                                       os.fstat(f.fileno()).st_size) is not None
            except (OSError, CorruptChunk):
                continue   # gone, or being replaced: a lookup will judge it
            if mine:
                with self._lock:
                    self._index[key] = None

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


def _stale_tmp(entry: os.DirEntry) -> bool:
    """A temporary file whose writer is gone: named by a dead process of this host, or old."""
    try:
        if time.time() - entry.stat().st_mtime > STALE_TMP_S:
            return True
    except OSError:
        return False
    parts = entry.name[:-len(TMP_SUFFIX)].split(".")   # <key>.kv.<host>.<pid>.<thread>
    if len(parts) < 5 or parts[-3] != HOST or not parts[-2].isdigit():
        return False
    pid = int(parts[-2])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass
    return False
