"""Per-request block tables on top of the block pool, with prefix caching."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_pod.core.block_pool import BlockPool
from engine_pod.core.kv_cache_block import KVCacheBlock
from engine_pod.core.prefix_cache_keys import PrefixCacheKeyLog
from engine_pod.request import Request
from kv_store.block_hash import BlockHash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, in tokens (vLLM's meaning of queries and hits)."""

    queries: int = 0
    hits: int = 0

    def reset(self) -> PrefixCacheStats:
        out = PrefixCacheStats(self.queries, self.hits)
        self.queries = self.hits = 0
        return out


class KVCacheManager:
    """Each request's block table over one BlockPool, and the prefix cache.

    Owns the pool (``block_pool``), every request's blocks (``req_to_blocks``)
    and how many of a request's leading blocks are registered in the prefix
    cache (``num_cached_blocks``). Called by the Scheduler on the engine
    thread (lookups on admission, allocate_slots every step, free on finish
    and preemption); ``num_cached_prefix_blocks`` and ``prefix_cache_keys``
    (thread-safe) also by the pod's load reports from the event-loop thread,
    read only.

    Invariants: a request's blocks hold at least its computed plus scheduled
    tokens (slots of rejected drafts stay allocated for the next step); a
    block enters the prefix cache once all its tokens are known and
    scheduled (never drafts), under the hash of its whole token prefix
    (Request.block_hashes); allocate_slots allocates everything asked or
    changes nothing; a freed request holds no blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # The cache's block keys, read by the pod's StreamLoad from the event-loop thread.
        self.prefix_cache_keys = PrefixCacheKeyLog()
        self.block_pool = BlockPool(num_blocks, enable_caching, self.prefix_cache_keys)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, as blocks and a token count.

        At least one token is always left to compute, because the last
        position's logits are needed to sample.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.find_cached_prefix(request.block_hashes[:max_hit_blocks])
        return hits, len(hits) * self.block_size

    def find_cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[KVCacheBlock]:
        """The cached blocks of the longest leading run of ``block_hashes``
        that the prefix cache holds."""
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_cached_prefix_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``block_hashes`` the prefix cache holds
        (the load report's prefix match). Safe from another thread: each
        lookup is one dict.get, atomic under the GIL; the answer is as of
        this instant."""
        return len(self.find_cached_prefix(block_hashes))

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (in tokens) in the stats."""
        if self.enable_caching:
            self.prefix_cache_stats.queries += num_tokens
            self.prefix_cache_stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of the request.

        ``new_computed_blocks`` are prefix-cache hits found for a request that
        is being scheduled from the waiting queue. Returns the newly allocated
        blocks, or None (changing nothing) when the pool cannot hold them.
        """
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be positive")
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(req_blocks) - len(new_computed_blocks)
        # Hits that sit in the free queue stop being free once touched.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_revived:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None

        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            # Blocks become hits as soon as they are scheduled: within a step,
            # every layer writes all new KV before any attention reads it.
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
            num_cached = self.num_cached_blocks.get(request.request_id, 0)
            if num_full > num_cached:
                self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full)
                self.num_cached_blocks[request.request_id] = num_full
        return new_blocks

    def free(self, request: Request) -> None:
        """Release a finished, aborted or preempted request's blocks."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self._uncache_uncomputed(request, blocks)
        self.block_pool.free_blocks(reversed(blocks))

    def _uncache_uncomputed(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        # A request preempted in the same step that scheduled it registered
        # blocks whose KV was never written. Blocks at or past its computed
        # length were allocated by it (hits always lie below), so they are
        # exactly the ones to withdraw from the prefix cache.
        first_uncomputed = request.num_computed_tokens // self.block_size
        for block in blocks[first_uncomputed:]:
            if block.block_hash is not None and block.ref_cnt == 1:
                self.block_pool.uncache_block(block)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_allocated_slots(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ())) * self.block_size

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
