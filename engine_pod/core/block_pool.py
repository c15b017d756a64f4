"""The block pool: allocation, ref counts, and the prefix-cache hash map."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from engine_pod.core.kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock
from engine_pod.core.prefix_cache_keys import PrefixCacheKeyLog
from kv_store.block_hash import BlockHash


class BlockPool:
    """Owns every KV block's metadata.

    Rules (vLLM V1): allocation pops from the free queue's head; a popped block
    that still carries a hash is evicted from the prefix cache first; freed
    blocks go to the tail, so the least recently freed are evicted first; a
    prefix-cache hit on a free block takes it out of the queue (revival).
    """

    def __init__(self, num_blocks: int, enable_caching: bool, key_log: PrefixCacheKeyLog | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Called with a block about to lose its cached KV (the KV store's offload hook).
        self.on_evict: Callable[[KVCacheBlock], None] | None = None
        # Told of every hash entering and leaving the cache (pushed to the gateways by StreamLoad).
        self.key_log = key_log

    # -- prefix cache -----------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under their hashes."""
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a prefix hit: already registered
            block_hash = block_hashes[i]
            if block_hash in self.cached_block_hash_to_block:
                # Same content computed twice concurrently: keep the first copy;
                # this one stays private and is reused as a plain free block.
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            if self.key_log is not None:
                self.key_log.stored(block_hash)

    # -- allocation -------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            self._maybe_evict(block)
            block.ref_cnt = 1
        return blocks

    def _maybe_evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.on_evict is not None:
            self.on_evict(block)
        self._forget(block)

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Withdraw a block from the prefix cache without offloading it."""
        if block.block_hash is not None:
            self._forget(block)

    def _forget(self, block: KVCacheBlock) -> None:
        """Take a cached block (its hash set) out of the prefix cache."""
        block_hash = block.block_hash
        assert block_hash is not None, block
        del self.cached_block_hash_to_block[block_hash]
        if self.key_log is not None:
            self.key_log.removed(block_hash)
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the tail in the
        given order (callers pass a request's blocks last-first, so a prefix's
        tail is evicted before its head)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refuses (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.key_log is not None:
            self.key_log.cleared()
        return True

    # -- accounting -------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks
