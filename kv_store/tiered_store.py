"""The tiered store: the host tier in front of the (optional) Redis tier.

``put`` (``put_many`` for a step's blocks) lands in the host tier at once and
reaches Redis through a bounded write-behind queue (full queue: the write is
dropped and counted, never waited for). Values bound for Redis are signed
(the codec's MAC) on the write-behind thread, off the engine step; a
synchronous put signs inline, and a step's synchronous blocks share one
pipeline round trip.
``get_blocks`` returns the leading run of valid blocks: host first, then one
Redis round trip for the rest; Redis values must pass the MAC, host values
(this process's own memory) need not; Redis hits are promoted to the host
tier; a value that fails any check is deleted from its tier and counted by
tier and reason, and the run stops there (a miss: the engine recomputes).

Blocks come and go as payloads (the raw bytes of one block, codec.py): the
store imports no torch, so a simulated engine uses it as a real one does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields

from kv_store.codec import BlockCodec, CorruptBlockError, Payload
from kv_store.host_tier import HostMemoryTier
from kv_store.redis_tier import RedisTier

logger = logging.getLogger(__name__)

# A write waiting for the write-behind thread: (block hash, encoded value); None stops the thread.
_Write = tuple[bytes, bytes]


@dataclass
class KVStoreStats:
    """Counters since start (blocks unless named otherwise)."""

    lookups: int = 0
    host_hits: int = 0
    redis_hits: int = 0
    bytes_read_host: int = 0
    bytes_read_redis: int = 0
    bytes_written_host: int = 0
    bytes_written_redis: int = 0
    writes_dropped: int = 0
    load_seconds: float = 0.0
    loads: int = 0
    # Values refused on read (and deleted), by (tier, reason): reasons are
    # kv_store.codec.REJECT_REASONS.
    rejected: Counter[tuple[str, str]] = field(default_factory=Counter)

    @property
    def rejected_values(self) -> int:
        return sum(self.rejected.values())

    def as_dict(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rejected"}
        out.update({f"rejected_{tier}_{reason}": n for (tier, reason), n in self.rejected.items()})
        return out


class TieredKVStore:
    def __init__(self, codec: BlockCodec, host: HostMemoryTier, remote: RedisTier | None = None,
                 write_queue_size: int = 256) -> None:
        if remote is not None and not codec.can_sign:
            raise ValueError("the Redis tier needs a KV MAC key (kv_mac_key): values in a shared tier are signed")
        self.codec = codec
        self.host = host
        self.remote = remote
        self.stats = KVStoreStats()
        self._stats_lock = threading.Lock()
        self._writes: queue.Queue[_Write | None] = queue.Queue(maxsize=write_queue_size)
        self._writer: threading.Thread | None = None
        if remote is not None:
            self._writer = threading.Thread(target=self._write_behind, args=(remote,), name="kv-write-behind",
                                            daemon=True)
            self._writer.start()

    # -- reads ------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> int:
        """How many leading blocks some tier holds (without reading them)."""
        n = self.host.num_leading_hits(hashes)
        if n == len(hashes) or self.remote is None:
            return n
        rest = hashes[n:]
        present = self.remote.exists_many([h for h in rest if h not in self.host])
        it = iter(present)
        for h in rest:
            if h not in self.host and not next(it):
                break
            n += 1
        return n

    def get_blocks(self, hashes: list[bytes]) -> list[memoryview]:
        """The payloads of the leading hashes that every check accepts (views of the stored values)."""
        if not hashes:
            return []
        start = time.perf_counter()
        blocks: list[memoryview] = []
        missing: list[int] = []
        values: list[bytes | None] = []
        for i, h in enumerate(hashes):
            value = self.host.get(h)
            values.append(value)
            if value is None:
                missing.append(i)
        if missing and self.remote is not None:
            fetched = self.remote.get_many([hashes[i] for i in missing])
            for i, value in zip(missing, fetched):
                values[i] = value
        from_remote = set(missing)
        host_hits = redis_hits = bytes_host = bytes_redis = 0
        rejected = None
        for i, (h, value) in enumerate(zip(hashes, values)):
            if value is None:
                break
            from_redis = i in from_remote
            try:
                blocks.append(self.codec.decode(h, value, verify_mac=from_redis))
            except CorruptBlockError as e:
                tier = "redis" if from_redis else "host"
                logger.warning("kv store: refusing block %s from %s (%s: %s); deleted", h.hex()[:12], tier,
                               e.reason, e)
                rejected = (tier, e.reason)
                if from_redis and self.remote is not None:
                    self.remote.delete(h)
                else:
                    self.host.delete(h)
                break
            if from_redis:
                redis_hits += 1
                bytes_redis += len(value)
                self.host.put(h, value)
            else:
                host_hits += 1
                bytes_host += len(value)
        elapsed = time.perf_counter() - start
        with self._stats_lock:
            s = self.stats
            s.lookups += len(hashes)
            s.host_hits += host_hits
            s.redis_hits += redis_hits
            s.bytes_read_host += bytes_host
            s.bytes_read_redis += bytes_redis
            if rejected is not None:
                s.rejected[rejected] += 1
            if blocks:
                s.loads += 1
                s.load_seconds += elapsed
        return blocks

    # -- writes -----------------------------------------------------------
    def put(self, block_hash: bytes, payload: Payload, sync_remote: bool = False) -> None:
        """Store a block's payload: host tier now, Redis behind (or now, with sync_remote)."""
        self.put_many([(block_hash, payload, sync_remote)])

    def put_many(self, blocks: list[tuple[bytes, Payload, bool]]) -> None:
        """Store blocks, each (hash, payload, sync_remote): host tier now; Redis behind, or, for the
        sync_remote ones (a prefill pod's output, which a decode pod reads next), now, all of them
        in one pipeline round trip (a step's saves wait for one trip, not one per block)."""
        now: list[tuple[bytes, bytes]] = []
        for block_hash, payload, sync_remote in blocks:
            value = self.codec.encode(block_hash, payload)
            if self.host.put(block_hash, value):
                with self._stats_lock:
                    self.stats.bytes_written_host += len(value)
            if self.remote is None:
                continue
            if sync_remote:
                now.append((block_hash, self.codec.sign(value)))
                continue
            try:
                self._writes.put_nowait((block_hash, value))
            except queue.Full:
                with self._stats_lock:
                    self.stats.writes_dropped += 1
        if now and self.remote is not None and self.remote.put_many(now):
            with self._stats_lock:
                self.stats.bytes_written_redis += sum(len(v) for _, v in now)

    def _write_behind(self, remote: RedisTier) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            batch = [item]
            # Drain what is queued into one pipeline round trip.
            while len(batch) < 64:
                try:
                    nxt = self._writes.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._flush_batch(remote, batch)
                    return
                batch.append(nxt)
            self._flush_batch(remote, batch)

    def _flush_batch(self, remote: RedisTier, batch: list[_Write]) -> None:
        signed = [(h, self.codec.sign(v)) for h, v in batch]
        if remote.put_many(signed):
            with self._stats_lock:
                self.stats.bytes_written_redis += sum(len(v) for _, v in signed)
        for _ in batch:
            self._writes.task_done()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued Redis writes are done (for tests and shutdown)."""
        deadline = time.monotonic() + timeout
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._writes.unfinished_tasks

    def close(self) -> None:
        if self._writer is not None:
            self.flush()
            self._writes.put(None)
            self._writer.join(timeout=5)
        if self.remote is not None:
            self.remote.close()
