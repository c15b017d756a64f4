"""The tiered store: the host tier in front of the (optional) Redis tier.

``put`` (``put_many`` for a step's blocks) lands in the host tier at once and
reaches Redis through a bounded write-behind queue (full queue: the write is
dropped and counted, never waited for). Values bound for Redis are signed
(the codec's MAC) on the write-behind thread, off the engine step; a
synchronous put signs inline, and a step's synchronous blocks share one
pipeline round trip.
``get_blocks`` returns the leading run of valid blocks: host first, then the
inbox (blocks a prefill pod pushed here over the direct P/D channel), then
one Redis round trip for the rest; inbox and Redis values must pass the MAC,
host values (this process's own memory) need not; Redis hits are promoted to
the host tier; a value that fails any check is deleted from its tier and counted by
tier and reason, and the run stops there (a miss: the engine recomputes).

Blocks come and go as payloads (the raw bytes of one block, codec.py): the
store imports no torch, so a simulated engine uses it as a real one does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field, fields

from kv_store.block_hash import NONE_HASH
from kv_store.codec import HEADER_SIZE, BlockCodec, CorruptBlockError, Payload
from kv_store.direct_sender import DirectSender, TransferResult
from kv_store.host_tier import HostMemoryTier
from kv_store.redis_tier import RedisTier

logger = logging.getLogger(__name__)

# A write waiting for the write-behind thread: (block hash, encoded value); None stops the thread.
_Write = tuple[bytes, bytes]
# Saves streamed to decode pods: block hash -> [(transfer id, the decode pod's address)].
Transfers = dict[bytes, list[tuple[str, str]]]


@dataclass
class KVStoreStats:
    """Counters since start (blocks unless named otherwise)."""

    lookups: int = 0
    host_hits: int = 0
    inbox_hits: int = 0
    redis_hits: int = 0
    bytes_read_host: int = 0
    bytes_read_inbox: int = 0
    bytes_read_redis: int = 0
    bytes_written_host: int = 0
    bytes_written_redis: int = 0
    # Blocks (and bytes) other pods pushed into the inbox.
    inbox_received: int = 0
    bytes_received_inbox: int = 0
    # P/D transfers out of this pod by channel ("redis": a prefill pod's synchronous writes, and
    # the direct pushes that fell back to it; "direct": pushes a decode pod took): bytes and
    # seconds spent (for Redis, the engine step's wait; for a push, first block to reply).
    transfer_bytes: Counter[str] = field(default_factory=Counter)
    transfer_seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    # Direct pushes by outcome: "ok", "fallback" (the blocks went to Redis), "failed" (nowhere).
    pushes: Counter[str] = field(default_factory=Counter)
    # Pushes a decode pod took, by data path: "socket" (its inbox socket) or "grpc" (PushKVBlocks).
    push_paths: Counter[str] = field(default_factory=Counter)
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
        out = {f.name: getattr(self, f.name) for f in fields(self) if not isinstance(getattr(self, f.name), dict)}
        out.update({f"rejected_{tier}_{reason}": n for (tier, reason), n in self.rejected.items()})
        for name in ("transfer_bytes", "transfer_seconds", "pushes", "push_paths"):
            out.update({f"{name}_{key}": n for key, n in getattr(self, name).items()})
        return out


class TieredKVStore:
    def __init__(self, codec: BlockCodec, host: HostMemoryTier, remote: RedisTier | None = None,
                 write_queue_size: int = 256, inbox: HostMemoryTier | None = None,
                 sender: DirectSender | None = None) -> None:
        """``inbox``: where other pods' pushes land (None: this pod takes none);
        ``sender``: the direct channel's sending half (None: every P/D save goes to Redis)."""
        if (remote is not None or inbox is not None or sender is not None) and not codec.can_sign:
            raise ValueError("the Redis tier and the direct channel need a KV MAC key (kv_mac_key): "
                             "values between pods are signed")
        self.codec = codec
        self.host = host
        self.remote = remote
        self.inbox = inbox
        self.sender = sender
        # The one length every value of this layout has (a pushed value of another is refused unread).
        self.value_bytes = HEADER_SIZE + codec.layout.payload_bytes
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
        values, tiers = self._fetch(hashes)
        read: Counter[str] = Counter()
        hits: Counter[str] = Counter()
        rejected = None
        for h, value, tier in zip(hashes, values, tiers):
            if value is None:
                break
            try:
                blocks.append(self.codec.decode(h, value, verify_mac=tier != "host"))
            except CorruptBlockError as e:
                logger.warning("kv store: refusing block %s from %s (%s: %s); deleted", h.hex()[:12], tier,
                               e.reason, e)
                rejected = (tier, e.reason)
                self._tier(tier).delete(h)  # type: ignore[union-attr]  # a tier that gave a value exists
                break
            hits[tier] += 1
            read[tier] += len(value)
            if tier == "redis":
                self.host.put(h, value)
        elapsed = time.perf_counter() - start
        with self._stats_lock:
            s = self.stats
            s.lookups += len(hashes)
            s.host_hits += hits["host"]
            s.inbox_hits += hits["inbox"]
            s.redis_hits += hits["redis"]
            s.bytes_read_host += read["host"]
            s.bytes_read_inbox += read["inbox"]
            s.bytes_read_redis += read["redis"]
            if rejected is not None:
                s.rejected[rejected] += 1
            if blocks:
                s.loads += 1
                s.load_seconds += elapsed
        return blocks

    def _fetch(self, hashes: list[bytes]) -> tuple[list[bytes | None], list[str]]:
        """Each hash's stored value (None: no tier has it) and the tier it came from."""
        values: list[bytes | None] = []
        tiers: list[str] = []
        missing: list[int] = []
        for i, h in enumerate(hashes):
            value, tier = self.host.get(h), "host"
            if value is None and self.inbox is not None:
                value, tier = self.inbox.get(h), "inbox"
            values.append(value)
            tiers.append(tier if value is not None else "redis")
            if value is None:
                missing.append(i)
        if missing and self.remote is not None:
            for i, value in zip(missing, self.remote.get_many([hashes[i] for i in missing])):
                values[i] = value
        return values, tiers

    def _tier(self, name: str) -> HostMemoryTier | RedisTier | None:
        """Where a refused value is deleted from."""
        return {"host": self.host, "inbox": self.inbox, "redis": self.remote}[name]

    # -- writes -----------------------------------------------------------
    def put(self, block_hash: bytes, payload: Payload, sync_remote: bool = False) -> None:
        """Store a block's payload: host tier now, Redis behind (or now, with sync_remote)."""
        self.put_many([(block_hash, payload, sync_remote)])

    def put_many(self, blocks: list[tuple[bytes, Payload, bool]], transfers: Transfers | None = None) -> None:
        """Store blocks, each (hash, payload, sync_remote): host tier now; Redis behind, or, for the
        sync_remote ones (a prefill pod's output, which a decode pod reads next), now, all of them
        in one pipeline round trip (a step's saves wait for one trip, not one per block).
        ``transfers``: the blocks streamed to a decode pod instead (the direct channel; Redis
        still gets them behind, as the shared prefix tier)."""
        now: list[tuple[bytes, bytes]] = []
        pushed: set[bytes] = set()  # a block two requests of the step saved is pushed once
        for block_hash, payload, sync_remote in blocks:
            value = self.codec.encode(block_hash, payload)
            if self.host.put(block_hash, value):
                with self._stats_lock:
                    self.stats.bytes_written_host += len(value)
            pushes = transfers.get(block_hash) if transfers and self.sender is not None else None
            if pushes:
                # The push is its way to the decode pod: Redis gets it behind, not now.
                sync_remote = False
                if block_hash not in pushed:
                    pushed.add(block_hash)
                    for transfer_id, target in pushes:
                        self.sender.send(transfer_id, target, block_hash, value)  # type: ignore[union-attr]
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
        if now and self.remote is not None:
            start = time.perf_counter()
            if self.remote.put_many(now):
                written = sum(len(v) for _, v in now)
                with self._stats_lock:
                    self.stats.bytes_written_redis += written
                    self.stats.transfer_bytes["redis"] += written
                    self.stats.transfer_seconds["redis"] += time.perf_counter() - start

    # -- the direct P/D channel ----------------------------------------------
    def receive(self, blocks: list[tuple[bytes, bytes]]) -> None:
        """Take blocks a prefill pod pushed (signed values) into the inbox.
        ValueError (nothing taken) if this pod has no inbox or a value cannot
        be one of this layout's; the MAC and header are checked when read."""
        if self.inbox is None:
            raise ValueError("this pod takes no pushed KV blocks (--kv-inbox-bytes is 0)")
        for block_hash, value in blocks:
            if len(block_hash) != len(NONE_HASH):
                raise ValueError(f"a block hash is {len(NONE_HASH)} bytes, got {len(block_hash)}")
            if len(value) != self.value_bytes:
                raise ValueError(f"a KV value of this model is {self.value_bytes} bytes, got {len(value)}")
        for block_hash, value in blocks:
            self.inbox.put(block_hash, value)
        with self._stats_lock:
            self.stats.inbox_received += len(blocks)
            self.stats.bytes_received_inbox += sum(len(v) for _, v in blocks)

    def finish_transfer(self, transfer_id: str) -> Future[TransferResult] | None:
        """The result of a request's push once delivered (None: this store sends nothing directly)."""
        if self.sender is None:
            return None
        future = self.sender.finish(transfer_id)
        future.add_done_callback(self._count_push)
        return future

    def _count_push(self, future: Future[TransferResult]) -> None:
        if future.cancelled():
            return
        result = future.result()
        if not result.num_blocks:
            return
        outcome = {"direct": "ok", "redis": "fallback"}.get(result.channel, "failed")
        with self._stats_lock:
            self.stats.pushes[outcome] += 1
            if outcome == "ok":
                self.stats.push_paths[result.data_path] += 1
            if result.channel != "none":
                self.stats.transfer_bytes[result.channel] += result.num_bytes
                self.stats.transfer_seconds[result.channel] += result.seconds

    def cancel_transfer(self, transfer_id: str) -> None:
        if self.sender is not None:
            self.sender.cancel(transfer_id)

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
        if self.sender is not None:
            self.sender.close()
        if self._writer is not None:
            self.flush()
            self._writes.put(None)
            self._writer.join(timeout=5)
        if self.remote is not None:
            self.remote.close()
