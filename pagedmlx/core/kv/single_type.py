"""One KV cache group's pages (vLLM's SingleTypeKVCacheManager): which blocks each request holds
in this group, its prefix hits and what it frees. The KVCacheManager coordinates the groups and
picks each group's manager by its spec (core/kv/manager.py: full and sliding window here, recurrent
state in core/kv/state_manager.py, which builds on this module and is never imported by it)."""

from __future__ import annotations

from typing import Optional, Sequence

from pagedmlx.core.kv.block_hash import BlockHash
from pagedmlx.core.kv.block_pool import BlockPool, KVCacheBlock
from pagedmlx.core.kv.spec import KVCacheSpec, SlidingWindowSpec, cdiv


class SingleTypeKVCacheManager:
    # A hit of n blocks cut to fewer is the hit for fewer (full attention): no second lookup.
    hits_are_prefixes = False

    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, enable_caching: bool):
        self.spec = spec
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, null_block=isinstance(spec, SlidingWindowSpec))
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}  # mirrors req_to_blocks, for building block tables
        self.num_cached_blocks: dict[str, int] = {}  # per request: blocks already hashed and cached

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        """The blocks of the longest cached prefix of at most max_blocks blocks (the pages this
        group needs of it; others may be the pool's null block)."""
        raise NotImplementedError

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the pages no later token of the request will read."""

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        """Free blocks this group must take for the request to hold `num_tokens` tokens, counting
        cached hits that sit in the free queue (about to be taken out of it)."""
        held = len(self.req_to_blocks.get(request_id, ()))
        num_new = cdiv(num_tokens, self.block_size) - held - len(new_computed_blocks)
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not self.block_pool.null_block)
        return max(num_new, 0) + num_revived

    def allocate(self, request_id: str, num_tokens: int,
                 new_computed_blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock]:
        """Take the hits and enough new blocks for `num_tokens` tokens (the caller checked room)."""
        held = self.req_to_blocks.setdefault(request_id, [])
        held_ids = self.req_to_block_ids.setdefault(request_id, [])
        self.block_pool.touch(new_computed_blocks)
        num_new = cdiv(num_tokens, self.block_size) - len(held) - len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new, 0))
        for block in (*new_computed_blocks, *new_blocks):
            held.append(block)
            held_ids.append(block.block_id)
        return new_blocks

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Record the request's blocks that are full at `num_tokens` under their hashes."""
        start = self.num_cached_blocks.get(request_id, 0)
        end = num_tokens // self.block_size
        blocks = self.req_to_blocks.get(request_id)
        if not self.enable_caching or end <= start or blocks is None:  # no block completed (most decode steps)
            return
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], block_hashes[i])
        self.num_cached_blocks[request_id] = end

    def uncache_from(self, request_id: str, num_valid_tokens: int) -> None:
        """Drop the hashes of the request's blocks past `num_valid_tokens` (never written)."""
        first = num_valid_tokens // self.block_size
        for block in self.req_to_blocks.get(request_id, [])[first:]:
            self.block_pool.uncache_block(block)
        if request_id in self.num_cached_blocks:
            self.num_cached_blocks[request_id] = min(self.num_cached_blocks[request_id], first)

    def held_blocks(self) -> list[list[KVCacheBlock]]:
        """Every list of blocks this group holds a reference on (the inspector's view)."""
        return list(self.req_to_blocks.values())

    def free(self, request_id: str) -> None:
        """Release the request's pages, tail first: the end of a chain is evicted before its head."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.req_to_block_ids.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))


class FullAttentionManager(SingleTypeKVCacheManager):
    hits_are_prefixes = True

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_blocks]:  # left to right: a prefix stops at its first miss
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    @property
    def sliding_window(self) -> int:
        return self.spec.sliding_window

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[KVCacheBlock]:
        """As vLLM: right to left, the first run of cdiv(W - 1, bs) cached blocks ends the hit (the
        window of the first token to compute); the blocks before the run are the null block. A run
        that reaches the start of the sequence is a hit however short."""
        needed = cdiv(self.sliding_window - 1, self.block_size)
        null = self.block_pool.null_block
        hits = [null] * max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[i])
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= needed:
                return hits[:i + run]
        return hits[:run]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """The next token, at num_computed_tokens, attends keys from num_computed_tokens - W + 1:
        whole pages before that go back to the pool (keeping their hashes, so other requests still
        hit them until they are evicted) and the null block takes their place."""
        blocks = self.req_to_blocks.get(request_id)
        first_needed = (num_computed_tokens - self.sliding_window + 1) // self.block_size
        if not blocks or first_needed <= 0:
            return
        null = self.block_pool.null_block
        ids = self.req_to_block_ids[request_id]
        freed = []
        for i in range(min(first_needed, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break  # everything before was freed by an earlier step
            freed.append(blocks[i])
            blocks[i], ids[i] = null, null.block_id
        self.block_pool.free_blocks(reversed(freed))  # the oldest is evicted first


def intersect_hits(managers: Sequence[SingleTypeKVCacheManager], block_hashes: Sequence[BlockHash],
                   max_blocks: int) -> tuple[list[list[KVCacheBlock]], int]:
    """vLLM's hybrid coordinator: the longest prefix every group has cached. Each group may only
    shorten the hit, so repeat until no group shortens it; one pass is enough for full + one window."""
    num_blocks: Optional[int] = None
    hits: list[Optional[list[KVCacheBlock]]] = [None] * len(managers)
    limit = max_blocks
    while num_blocks != limit:
        num_blocks = limit
        for g, manager in enumerate(managers):
            if hits[g] is not None and manager.hits_are_prefixes:
                hits[g] = hits[g][:limit]
            else:
                hits[g] = manager.find_longest_cache_hit(block_hashes, limit)
            limit = min(limit, len(hits[g]))
    return [h[:num_blocks] for h in hits], num_blocks
