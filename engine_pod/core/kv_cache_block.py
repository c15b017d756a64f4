"""KV cache blocks and the doubly linked free-block queue."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kv_store.block_hash import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    """Metadata of one physical KV block (the tensors live in the model runner)."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is full and registered in the prefix cache.
    block_hash: BlockHash | None = None
    # Links of the free-block queue; None while the block is in use.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the head is evicted (reused) first.

    A hand-made doubly linked list through the blocks themselves, because a
    prefix-cache hit must take a free block out of the middle in O(1); deque and
    OrderedDict cannot do that without a search or an extra dict.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head first (for tests and debugging: O(free blocks))."""
        out = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out
