"""The pods' prefix caches as they push them (`router.prefix_match: pushed`).

Each pod streams its prefix cache's contents as 64-bit block keys
(kv_store.block_hash.block_key) in its load reports: the whole set first
(`reset`), then what was stored and evicted since the last report
(Engine.StreamLoad with `prefix_cache_keys`). This index applies them, so
the router learns how many of a prompt's leading blocks a pod holds, and
which pods hold the deepest of them, without a call on the request path.

It holds, per pod, the set of its keys, and per key a bitmask of the pods
holding it (a pod's bit is its slot, reused once it leaves): a key shared
by every pod (a tenant's system prompt) costs one int, not a set per key.
Every gateway replica builds its own index from the same pushes, so they
agree on what each pod holds up to one report interval, and share nothing.

A push trails the cache by up to one report interval, so a burst of
requests sharing a new prefix would find it nowhere. What this gateway
routes therefore counts as held at once (`note_routed`), as a pending key
of the chosen pod, until the pod's push confirms it or PENDING_TTL_S
passes (the request failed, or its blocks were evicted before a push saw
them): the pushed twin of the load's dispatched_since_report.

What a pod pushes is believed only up to its size: a pod cannot hold more
blocks than its KV pool (`num_kv_blocks`, at most `max_keys_per_pod`); keys
beyond that are dropped, so a faulty pod cannot grow the gateway's memory
without bound. A wrong key can only mislead a routing choice: the pod
matches a request's blocks by their full hashes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator

from gateway.config import RouterConfig
from tessera.v1 import engine_pb2 as epb

logger = logging.getLogger(__name__)

# The most holders of one key looked at per request: a key every pod holds
# (a system prompt) must not cost a pass over the fleet.
MAX_HOLDERS_SCANNED = 32
# How long a routed prompt's blocks count as held by its pod without the
# pod's push saying so: long enough for a queued request's prefill to run
# and be pushed, short enough that a failed one misleads briefly.
PENDING_TTL_S = 10.0


class PrefixIndex:
    """Block key -> the pods holding it, from the pods' pushed reports."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 max_keys_per_pod: int = RouterConfig.max_pushed_blocks_per_pod) -> None:
        # Times the pending keys (note_routed); tests pass their own.
        self._clock = clock
        # The most keys believed of one pod, whatever its report says (router.max_pushed_blocks_per_pod).
        self.max_keys_per_pod = max_keys_per_pod
        self._holders: dict[int, int] = {}
        self._keys: dict[str, set[int]] = {}
        self._slot: dict[str, int] = {}
        self._address_of_slot: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._overflowed: set[str] = set()
        # Keys counted as held because this gateway routed them (note_routed):
        # per pod, key -> expiry; and every (expiry, address, key) in expiry order.
        self._pending: dict[str, dict[int, float]] = {}
        self._pending_order: deque[tuple[float, str, int]] = deque()

    def add(self, address: str) -> None:
        if address in self._slot:
            return
        slot = self._free_slots.pop() if self._free_slots else len(self._slot)
        self._slot[address] = slot
        self._address_of_slot[slot] = address
        self._keys[address] = set()
        self._pending[address] = {}

    def remove(self, address: str) -> None:
        if address not in self._slot:
            return
        self.clear(address)
        slot = self._slot.pop(address)
        del self._address_of_slot[slot]
        del self._keys[address]
        del self._pending[address]
        self._free_slots.append(slot)
        self._overflowed.discard(address)

    def clear(self, address: str) -> None:
        """Forget what the pod holds (its stream restarts with a new set)."""
        keys = self._keys.get(address)
        if not keys:
            return
        bit = 1 << self._slot[address]
        for key in keys:
            self._drop_holder(key, bit)
        keys.clear()
        self._pending[address].clear()

    def apply(self, address: str, update: epb.PrefixCacheKeys, num_kv_blocks: int) -> None:
        """Apply one report's keys: removals, then stores, capped at the pod's size."""
        keys = self._keys.get(address)
        if keys is None:
            return
        self._expire(self._clock())
        if update.reset:
            self.clear(address)
        bit = 1 << self._slot[address]
        pending = self._pending[address]
        for key in update.removed:
            if key in keys:
                keys.discard(key)
                pending.pop(key, None)
                self._drop_holder(key, bit)
        limit = min(num_kv_blocks, self.max_keys_per_pod) if num_kv_blocks > 0 else self.max_keys_per_pod
        holders = self._holders
        for key in update.stored:
            if key in keys:
                pending.pop(key, None)  # confirmed by the pod
                continue
            if len(keys) >= limit:
                self._overflow(address, limit)
                break
            keys.add(key)
            holders[key] = holders.get(key, 0) | bit

    def note_routed(self, address: str, block_keys: list[int]) -> None:
        """This gateway sent a prompt with these block keys to the pod: count
        them as held (pending) until its push confirms them or they expire."""
        keys = self._keys.get(address)
        if keys is None or not block_keys:
            return
        now = self._clock()
        self._expire(now)
        pending, bit, expiry = self._pending[address], 1 << self._slot[address], now + PENDING_TTL_S
        for key in block_keys:
            if key in keys:
                if key in pending:
                    pending[key] = expiry
                    self._pending_order.append((expiry, address, key))
                continue
            if len(keys) >= self.max_keys_per_pod:
                break
            keys.add(key)
            self._holders[key] = self._holders.get(key, 0) | bit
            pending[key] = expiry
            self._pending_order.append((expiry, address, key))

    def _expire(self, now: float) -> None:
        """Drop the pending keys whose time is up and that no push confirmed."""
        order = self._pending_order
        while order and order[0][0] <= now:
            expiry, address, key = order.popleft()
            pending = self._pending.get(address)
            if pending is None or pending.get(key) != expiry:
                continue  # confirmed, refreshed, dropped, or its pod left
            del pending[key]
            self._keys[address].discard(key)
            self._drop_holder(key, 1 << self._slot[address])

    def matched_blocks(self, address: str, block_keys: list[int]) -> int:
        """The prompt's leading blocks the pod holds, as it last pushed them."""
        keys = self._keys.get(address)
        if not keys:
            return 0
        matched = 0
        for key in block_keys:
            if key not in keys:
                break
            matched += 1
        return matched

    def deepest_holders(self, block_keys: list[int]) -> tuple[int, list[str]]:
        """The longest run of the prompt's leading blocks that some pod holds
        whole (its length, 0 if none) and the pods holding it (at most
        MAX_HOLDERS_SCANNED): the pods each bitmask names, narrowed block by
        block."""
        depth, mask = 0, -1
        for key in block_keys:
            narrowed = mask & self._holders.get(key, 0)
            if not narrowed:
                break
            depth, mask = depth + 1, narrowed
        return depth, list(self._addresses(mask)) if depth else []

    def num_keys(self) -> int:
        """Distinct keys held by any pod (a gauge: the index's size)."""
        return len(self._holders)

    def _addresses(self, mask: int) -> Iterator[str]:
        for _ in range(MAX_HOLDERS_SCANNED):
            if not mask:
                return
            low = mask & -mask
            mask ^= low
            yield self._address_of_slot[low.bit_length() - 1]

    def _drop_holder(self, key: int, bit: int) -> None:
        remaining = self._holders.get(key, 0) & ~bit
        if remaining:
            self._holders[key] = remaining
        else:
            self._holders.pop(key, None)

    def _overflow(self, address: str, limit: int) -> None:
        if address not in self._overflowed:
            self._overflowed.add(address)
            logger.warning("pool: pod %s pushed more prefix-cache keys than its %d KV blocks; "
                           "keeping %d", address, limit, limit)
