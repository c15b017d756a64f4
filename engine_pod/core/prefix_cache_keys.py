"""The prefix cache's contents as block keys, and a bounded log of their changes.

A pod pushes these to the gateways in its StreamLoad reports
(LoadReport.prefix_cache) so they can match a prompt's blocks against every
pod's cache locally instead of asking each pod per request (GetLoad). Keys are
``kv_store.block_hash.block_key``: the first 8 bytes of a block's hash.

Written by the engine thread (the BlockPool, on every cache change); read by
the server's asyncio thread (one cursor per StreamLoad subscriber). Torch-free:
simulated pods run it too.
"""

from __future__ import annotations

import threading
from collections import deque
from itertools import islice

from kv_store.block_hash import BlockHash, block_key

# Changes kept for readers that are behind; one falling further back resyncs
# from a snapshot. At a report every 200 ms this covers over 300k changes a
# second, far more than a pod's cache turns over.
DEFAULT_MAX_CHANGES = 65536

# A reader's position: the sequence number of the first change it has not seen.
Cursor = int


class PrefixCacheKeyLog:
    """The keys of the blocks now in the prefix cache (a mirror of
    BlockPool.cached_block_hash_to_block) and the last ``max_changes`` changes
    to that set, numbered.

    The lock exists because the reader runs on another thread: a snapshot and
    the cursor returned with it must name the same instant (a change landing
    between the two would be lost or sent twice), and so must the changes a
    reader takes and its new cursor. Every writer call is one lock, one dict
    operation and one deque append.

    Invariants: the log holds the changes numbered ``[next - len, next)``; a
    change is logged only when the set of keys changes (a key's first block
    stored, its last removed), so replaying the log from a snapshot's cursor
    rebuilds the current set; ``cleared`` burns a sequence number, so every
    earlier cursor falls off the log and its reader takes a snapshot again.
    """

    def __init__(self, max_changes: int = DEFAULT_MAX_CHANGES) -> None:
        if max_changes < 1:
            raise ValueError(f"max_changes must be >= 1, got {max_changes}")
        self._lock = threading.Lock()
        # Key -> cached blocks under it: two hashes sharing a key (a 64-bit
        # collision) keep the key until both are gone.
        self._counts: dict[int, int] = {}
        # (key, stored) per change, oldest first; the deque drops from the left.
        self._changes: deque[tuple[int, bool]] = deque(maxlen=max_changes)
        # Sequence number of the next change.
        self._next = 0

    # -- writer: the engine thread (BlockPool) ------------------------------
    def stored(self, block_hash: BlockHash) -> None:
        """A block entered the prefix cache under ``block_hash``."""
        key = block_key(block_hash)
        with self._lock:
            count = self._counts.get(key, 0)
            self._counts[key] = count + 1
            if count == 0:
                self._append(key, True)

    def removed(self, block_hash: BlockHash) -> None:
        """The block cached under ``block_hash`` left the prefix cache."""
        key = block_key(block_hash)
        with self._lock:
            count = self._counts.get(key, 0)
            if count > 1:
                self._counts[key] = count - 1
            elif count == 1:
                del self._counts[key]
                self._append(key, False)

    def cleared(self) -> None:
        """The whole prefix cache was forgotten (reset_prefix_cache)."""
        with self._lock:
            self._counts.clear()
            self._changes.clear()
            self._next += 1  # no cursor from before can match the log again

    def _append(self, key: int, stored: bool) -> None:
        self._changes.append((key, stored))
        self._next += 1

    # -- reader: the server's event loop -----------------------------------
    def snapshot(self) -> tuple[Cursor, list[int]]:
        """Every key now cached, and the cursor just after them."""
        with self._lock:
            return self._next, list(self._counts)

    def changes_since(self, cursor: Cursor) -> tuple[Cursor, list[int], list[int]] | None:
        """The net change since ``cursor``: (new cursor, keys stored, keys
        removed), the two disjoint; per key its last change wins, so a key
        stored and removed since is only in ``removed`` (even if the reader
        never had it). None when the cursor fell off the log (too far behind,
        or a clear since): the reader must take a snapshot again."""
        with self._lock:
            n = self._next - cursor
            if n < 0 or n > len(self._changes):
                return None
            # The newest n changes, newest first: O(n), not O(log length).
            recent = list(islice(reversed(self._changes), n))
            new_cursor = self._next
        last: dict[int, bool] = {}
        for key, stored in recent:
            last.setdefault(key, stored)
        stored_keys = [k for k, s in last.items() if s]
        removed_keys = [k for k, s in last.items() if not s]
        return new_cursor, stored_keys, removed_keys

    def __len__(self) -> int:
        """Keys now cached."""
        with self._lock:
            return len(self._counts)
