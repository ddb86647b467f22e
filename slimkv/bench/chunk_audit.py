"""An independent audit of a disk tier directory (``kv_cache.offload.disk_path``): every
``.kv`` file checked against its own header (magic, key = file name, length, CRC-32 of the
payload), and the temporary files counted. The crash checks run it right after a
``kill -9``, before any server reads the directory again."""

from __future__ import annotations

import os
import zlib
from dataclasses import asdict, dataclass

from slimkv.kv.offload.disk import HEADER, MAGIC, SUFFIX, TMP_SUFFIX


@dataclass(slots=True)
class Audit:
    chunks: int = 0        # complete, checksummed chunk files
    bad: int = 0           # truncated, wrong length, bad magic/key or checksum
    tmp: int = 0           # temporary files (a write cut short, or one in flight)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def audit_chunks(path: str) -> Audit:
    out = Audit()
    for entry in os.scandir(path):
        if entry.name.endswith(TMP_SUFFIX):
            out.tmp += 1
        elif entry.name.endswith(SUFFIX):
            ok = _check(entry.path, entry.name[:-len(SUFFIX)])
            out.chunks += ok
            out.bad += not ok
    return out


def _check(path: str, key_hex: str) -> bool:
    try:
        with open(path, "rb") as f:
            data = f.read()
        magic, key, _, crc, size = HEADER.unpack(data[:HEADER.size])
    except (OSError, Exception):
        return False
    return (magic == MAGIC and key.hex() == key_hex and len(data) == HEADER.size + size
            and zlib.crc32(memoryview(data)[HEADER.size:]) == crc)
