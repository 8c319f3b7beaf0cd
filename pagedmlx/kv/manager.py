"""KVCacheManager: which pages each request holds, prefix-cache lookups and slot allocation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from pagedmlx.kv.block_hash import hash_request_blocks
from pagedmlx.kv.block_pool import BlockPool, KVCacheBlock
from pagedmlx.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Counters, in tokens. A preempted request re-finding its own pages is counted apart, so that
    the hit rate of fresh requests is not flattered by recomputation after preemption."""

    queries: int = 0
    hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}  # mirrors req_to_blocks, for building block tables
        self.num_cached_blocks: dict[str, int] = {}  # per request: blocks already hashed and cached
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def block_pools(self) -> list[BlockPool]:
        return [self.block_pool]

    def _extra_keys(self, request: Request) -> Optional[tuple]:
        return (request.cache_salt,) if request.cache_salt is not None else None

    def update_block_hashes(self, request: Request) -> None:
        """Hash the request's newly full blocks (each block is hashed once, stored on the request)."""
        if self.enable_caching:
            hash_request_blocks(request.all_token_ids, self.block_size, request.block_hashes,
                                self._extra_keys(request))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, as blocks and a token count.

        Never the whole sequence: the last token is always recomputed so that there are logits to
        sample from. Does not count in the stats (a request blocked at the head of the queue is looked
        up every step); the caller records the lookup that admits it with record_prefix_query.
        """
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        if not self.enable_caching:
            return
        if request.num_preemptions > 0:
            self.stats.preempted_queries += request.num_tokens
            self.stats.preempted_hits += num_hit_tokens
        else:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> Optional[list[KVCacheBlock]]:
        """Pages for `num_new_tokens` more tokens after the request's computed (and newly found
        cached) tokens. All or nothing: None, with nothing changed, if the pool cannot hold them.
        Returns the newly allocated blocks."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        held = self.req_to_blocks.get(request.request_id)
        if held is not None and not new_computed_blocks and len(held) * self.block_size >= total_tokens:
            # The common decode: the pages held have room, nothing to take from the pool.
            self._cache_full_blocks(request, min(total_tokens, request.num_tokens))
            return []
        held = self.req_to_blocks.setdefault(request.request_id, [])
        held_ids = self.req_to_block_ids.setdefault(request.request_id, [])
        num_new_blocks = cdiv(total_tokens, self.block_size) - len(held) - len(new_computed_blocks)
        # Cached hits that sit in the free queue are not free for this request: it is about to use them.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_revived:
            if not held:
                del self.req_to_blocks[request.request_id]
                del self.req_to_block_ids[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        for block in (*new_computed_blocks, *new_blocks):
            held.append(block)
            held_ids.append(block.block_id)
        # Cache the blocks that this step fills, so that later requests of the same step share them:
        # within each layer every new K/V is written before any page is read.
        self._cache_full_blocks(request, min(total_tokens, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        if not self.enable_caching or end <= start:  # no block completed (most decode steps)
            return
        self.update_block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = end

    def uncache_uncomputed(self, request: Request, num_valid_tokens: int) -> None:
        """Drop the hashes of the request's blocks past `num_valid_tokens` (their KV was never written,
        e.g. the step that was to write them failed)."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        first = num_valid_tokens // self.block_size
        for block in blocks[first:]:
            self.block_pool.uncache_block(block)
        if request.request_id in self.num_cached_blocks:
            self.num_cached_blocks[request.request_id] = min(self.num_cached_blocks[request.request_id], first)

    def uncache_block_ids(self, block_ids: Iterable[int]) -> None:
        """Drop the hashes of these pages, whoever holds them now."""
        for i in block_ids:
            self.block_pool.uncache_block(self.block_pool.blocks[i])

    def free(self, request: Request) -> None:
        """Release the request's pages, tail first: the end of a chain is evicted before its head."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_block_ids.get(request_id, [])

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)
