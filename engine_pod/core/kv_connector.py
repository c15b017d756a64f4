"""The scheduler side of the KV-store connector (in the spirit of vLLM's).

After the local prefix-cache lookup, ``match`` asks the store for further
leading blocks. It reads and validates them right away, so a block counted
as computed can no longer go missing before the forward: what the engine
counts is what it loads. Newly filled full blocks are saved after the
forward; cached blocks evicted from the device pool are offloaded to the
host tier before they are overwritten.
"""

from __future__ import annotations

from engine_pod.core.kv_cache_block import KVCacheBlock
from engine_pod.core.scheduler_output import KVConnectorMetadata
from engine_pod.request import Request
from kv_store.tiered_store import TieredKVStore


class KVConnectorScheduler:
    def __init__(self, store: TieredKVStore, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self._meta = KVConnectorMetadata()
        # Tokens served from the store since the last stats report.
        self.num_external_hit_tokens = 0

    def match(self, request: Request, num_local_hit_tokens: int) -> list[memoryview]:
        """The payloads of the blocks the store holds right after the local
        hits (at least one prompt token is always left to compute)."""
        first = num_local_hit_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size
        if first >= last:
            return []
        return self.store.get_blocks(request.block_hashes[first:last])

    def on_allocated(self, new_blocks: list[KVCacheBlock], loaded: list[memoryview]) -> None:
        """The first new blocks of an admitted request receive the loaded KV."""
        self._meta.loads.extend((b.block_id, data) for b, data in zip(new_blocks, loaded))
        self.num_external_hit_tokens += len(loaded) * self.block_size

    def on_scheduled(self, request: Request, blocks: list[KVCacheBlock], num_computed: int, num_new: int) -> None:
        """Save the full blocks this step completes."""
        sync = request.kv_transfer_mode == "produce"
        end = min(num_computed + num_new, request.num_tokens) // self.block_size
        start = num_computed // self.block_size
        target = request.kv_transfer_target if sync else None
        if target is not None:
            # The decode pod needs the whole prompt, the blocks this pod had
            # cached (not computed here, so never saved now) included.
            start = min(start, request.num_kv_blocks_pushed)
            request.num_kv_blocks_pushed = max(request.num_kv_blocks_pushed, end)
        for i in range(start, end):
            block_hash = request.block_hashes[i]
            if sync or block_hash not in self.store.host:
                self._meta.saves.append((blocks[i].block_id, block_hash, sync))
            if target is not None:  # another producer of this step may save the same block
                self._meta.transfers.setdefault(block_hash, []).append((request.request_id, target))

    def on_evict(self, block: KVCacheBlock) -> None:
        """BlockPool hook: a cached block (it has a hash) is about to be reused."""
        block_hash = block.block_hash
        if not self.store.host.capacity_bytes:
            return  # no host tier (Redis alone): the copy would only be thrown away
        if block_hash is not None and block_hash not in self.store.host:
            self._meta.offloads.append((block.block_id, block_hash))

    def on_preempted(self, request: Request) -> None:
        """A request preempted in the step that scheduled it computes nothing:
        drop its saves (their blocks were never written)."""
        # Its blocks may already be reused by others in this step, so match by
        # hash: saves of a block id are only valid if the hash still names it.
        hashes = set(request.block_hashes)
        self._meta.saves = [s for s in self._meta.saves if s[1] not in hashes]
        for block_hash in hashes & self._meta.transfers.keys():
            rest = [t for t in self._meta.transfers[block_hash] if t[0] != request.request_id]
            if rest:
                self._meta.transfers[block_hash] = rest
            else:
                del self._meta.transfers[block_hash]
        request.num_kv_blocks_pushed = 0  # its next schedule pushes them again (a push is idempotent)

    def take_external_hit_tokens(self) -> int:
        """Tokens served from the store since the last call (a stats report)."""
        hits, self.num_external_hit_tokens = self.num_external_hit_tokens, 0
        return hits

    def take_metadata(self) -> KVConnectorMetadata | None:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta if meta else None
