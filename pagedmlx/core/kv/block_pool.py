"""The page pool's bookkeeping: blocks, the LRU free queue and the prefix-cache map.

A block is free when no request references it (ref_cnt == 0); a free block that still carries
a hash keeps its KV and can be revived by a prefix-cache hit until its id is handed out again
(lazy eviction). The free queue's head is evicted first.
"""

from __future__ import annotations

from typing import Iterable, Optional

from pagedmlx.core.kv.block_hash import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHash] = None
        self.prev_free_block: Optional[KVCacheBlock] = None
        self.next_free_block: Optional[KVCacheBlock] = None

    @property
    def is_free(self) -> bool:
        return self.ref_cnt == 0

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "-"
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, {cached})"


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list of free blocks: O(1) pop, append and removal from the middle.

    The links live on the blocks themselves, between two sentinels, so that a prefix-cache hit
    can take a free block out of the queue without searching for it.
    """

    def __init__(self, blocks: list[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def _insert_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        nxt = anchor.next_free_block
        block.prev_free_block, block.next_free_block = anchor, nxt
        anchor.next_free_block = block
        nxt.prev_free_block = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free_block, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def __iter__(self):
        block = self._head.next_free_block
        while block is not self._tail:
            yield block
            block = block.next_free_block

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """Owns every KVCacheBlock: hands out free ones, revives cached ones, takes them back.

    With a null block (sliding-window groups, as vLLM), block 0 is never handed out: it stands in a
    request's block table for the pages behind its window, which it no longer holds."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, null_block: bool = False):
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[int(null_block):])
        self.null_block: Optional[KVCacheBlock] = self.blocks[0] if null_block else None
        self.num_blocks = num_blocks - int(null_block)  # blocks that can be handed out
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue, evicting their cached KV."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks: {self.get_num_free_blocks()} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Record a full block under its hash. The first block to hold a chain keeps the key;
        a later duplicate (computed before the first was cached) stays private and uncached."""
        if not self.enable_caching or block.block_hash is not None or block is self.null_block:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget a block's hash (its KV is not valid, e.g. the step that wrote it failed)."""
        self._evict(block)  # the null block never holds a hash

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in eviction order (first is evicted first).

        Blocks that reach ref_cnt 0 with a hash join the queue's tail (most recently used); blocks
        without a hash hold nothing reusable and join the head, to be handed out first.
        """
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (every hashed block is in the map)."""
        return sum(1 for b in self.cached_block_hash_to_block.values() if b.ref_cnt == 0)
