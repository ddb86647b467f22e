"""The host tier: chunks in a preallocated block of host memory, least recently used first
out.

Every chunk of one format has the same size, so the budget is cut once into fixed slots
(``capacity_bytes // chunk_bytes`` of them); storing a chunk when every slot is taken
evicts the least recently used one and hands it back to the caller, who spills it to disk.
On CUDA the buffer is pinned, so copies to and from the device run at full speed.
Thread-safe: the writer thread stores while the engine thread loads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch import Tensor


class HostTier:
    def __init__(self, capacity_bytes: int, chunk_bytes: int, pin: bool = False) -> None:
        self.chunk_bytes = chunk_bytes
        self.num_slots = max(0, capacity_bytes) // chunk_bytes
        self.buffer = torch.empty(self.num_slots, chunk_bytes, dtype=torch.uint8,
                                  pin_memory=pin and self.num_slots > 0)
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, LRU first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.chunk_bytes

    @property
    def num_bytes(self) -> int:
        return len(self._slots) * self.chunk_bytes

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def keys(self) -> list[bytes]:
        """Stored keys, least recently used first."""
        with self._lock:
            return list(self._slots)

    def put(self, key: bytes, payload: Tensor) -> list[tuple[bytes, Tensor]]:
        """Store a chunk; returns the chunks evicted to make room (their payloads copied
        out), or ``[(key, payload)]`` itself when the tier holds no slot at all."""
        if self.num_slots == 0:
            return [(key, payload)]
        evicted = []
        with self._lock:
            if key in self._slots:
                self._slots.move_to_end(key)
                return []
            if not self._free:
                old_key, slot = self._slots.popitem(last=False)
                evicted.append((old_key, self.buffer[slot].clone()))
                self._free.append(slot)
            slot = self._free.pop()
            self.buffer[slot].copy_(payload)
            self._slots[key] = slot
        return evicted

    def get(self, key: bytes) -> Tensor | None:
        """A copy of the chunk's payload (and it becomes the most recently used), or None."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return None
            self._slots.move_to_end(key)
            return self.buffer[slot].clone()
