"""The host-memory tier: encoded blocks in this process, byte-bounded, LRU."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable


class HostMemoryTier:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"kv host tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.evictions = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def num_leading_hits(self, hashes: Iterable[bytes]) -> int:
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self._blocks:
                    break
                n += 1
        return n

    def get(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            value = self._blocks.get(block_hash)
            if value is not None:
                self._blocks.move_to_end(block_hash)
            return value

    def put(self, block_hash: bytes, value: bytes) -> bool:
        """Insert (or refresh) a block; False when it can never fit."""
        if len(value) > self.capacity_bytes:
            return False
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            if old is not None:
                self.used_bytes -= len(old)
            while self.used_bytes + len(value) > self.capacity_bytes:
                _, evicted = self._blocks.popitem(last=False)
                self.used_bytes -= len(evicted)
                self.evictions += 1
            self._blocks[block_hash] = value
            self.used_bytes += len(value)
        return True

    def delete(self, block_hash: bytes) -> None:
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            if old is not None:
                self.used_bytes -= len(old)

    def lru_order(self) -> list[bytes]:
        """Hashes from least to most recently used (for tests and debugging)."""
        with self._lock:
            return list(self._blocks)
