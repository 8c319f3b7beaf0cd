"""KVCacheManager: the coordinator of a model's KV cache groups (vLLM's KVCacheManager over its
hybrid coordinator): prefix-cache lookups intersected across groups, slot allocation all or nothing
across groups, every group freed together. A recurrent-state group (core/kv/state_manager.py), if any,
is the last group: its hit is a checkpoint that covers exactly the prefix skipped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from pagedmlx.core.kv.block_hash import hash_request_blocks
from pagedmlx.core.kv.block_pool import BlockPool, KVCacheBlock
from pagedmlx.core.kv.single_type import (FullAttentionManager, SingleTypeKVCacheManager, SlidingWindowManager,
                                     intersect_hits)
from pagedmlx.core.kv.spec import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec, SlidingWindowSpec, cdiv
from pagedmlx.core.kv.state_manager import StateManager
from pagedmlx.request import Request

__all__ = ["KVCacheBlocks", "KVCacheManager", "PrefixCacheStats", "cdiv"]

# A request's blocks in each group (vLLM's KVCacheBlocks.blocks), group 0 first.
KVCacheBlocks = tuple[list[KVCacheBlock], ...]

# Each layer kind's manager (vLLM's spec_manager_map).
SPEC_MANAGER_MAP: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager, SlidingWindowSpec: SlidingWindowManager, MambaSpec: StateManager}


def make_single_type_manager(spec: KVCacheSpec, num_blocks: int, block_size: int,
                             enable_caching: bool) -> SingleTypeKVCacheManager:
    """The manager of one KV cache group, by its spec (vLLM's get_manager_for_kv_cache_spec)."""
    return SPEC_MANAGER_MAP[type(spec)](spec, num_blocks, block_size, enable_caching)


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
    def __init__(self, kv_cache_config: KVCacheConfig | int, block_size: Optional[int] = None,
                 enable_caching: bool = True):
        """kv_cache_config, or (num_blocks, block_size) for one full-attention group."""
        if isinstance(kv_cache_config, int):
            kv_cache_config = KVCacheConfig.full_attention(kv_cache_config, block_size)
        self.kv_cache_config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.enable_caching = enable_caching
        self.managers: list[SingleTypeKVCacheManager] = [
            make_single_type_manager(g.kv_cache_spec, g.num_blocks, self.block_size, enable_caching)
            for g in kv_cache_config.kv_cache_groups]
        self.state_manager: Optional[StateManager] = next(
            (m for m in self.managers if isinstance(m, StateManager)), None)
        if self.state_manager is not None and self.state_manager is not self.managers[-1]:
            raise ValueError("the recurrent-state group must be the last KV cache group")
        self.stats = PrefixCacheStats()

    # The first group's bookkeeping (the only group of a plain-attention model).
    @property
    def block_pool(self) -> BlockPool:
        return self.managers[0].block_pool

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        return self.managers[0].req_to_blocks

    @property
    def block_pools(self) -> list[BlockPool]:
        return [m.block_pool for m in self.managers]

    @property
    def usage(self) -> float:
        """The fullest group's share of blocks in use."""
        return max(pool.get_usage() for pool in self.block_pools)

    def _extra_keys(self, request: Request) -> Optional[tuple]:
        """What besides the tokens a block's KV depends on: the cache salt, and the LoRA adapter
        (a page computed with adapter A never serves adapter B or the base model; its id, name and
        folder: an id freed by remove_lora may name another adapter later)."""
        keys = (request.cache_salt,) if request.cache_salt is not None else ()
        lora = request.lora_request
        if lora is not None:
            keys += (("lora", lora.lora_int_id, lora.lora_name, lora.lora_path),)
        return keys or None

    def update_block_hashes(self, request: Request) -> None:
        """Hash the request's newly full blocks (each block is hashed once, stored on the request)."""
        if self.enable_caching:
            hash_request_blocks(request.all_token_ids, self.block_size, request.block_hashes,
                                self._extra_keys(request), request.mm_features)

    def get_computed_blocks(self, request: Request, max_tokens: Optional[int] = None) -> tuple[KVCacheBlocks, int]:
        """The longest prefix of the request that every group has cached, as each group's blocks
        and a token count.

        Never the whole sequence: the last token is always recomputed so that there are logits to
        sample from. Does not count in the stats (a request blocked at the head of the queue is looked
        up every step); the caller records the lookup that admits it with record_prefix_query.
        A request that wants its prompt's logprobs computes every prompt token (as vLLM): no hit.
        max_tokens: the hit ends at or before it (a whole number of blocks).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return tuple([] for _ in self.managers), 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_tokens is not None:
            max_blocks = min(max_blocks, max_tokens // self.block_size)
        hits, num_blocks = intersect_hits(self.managers, request.block_hashes, max_blocks)
        if self.state_manager is not None and num_blocks:
            self._check_state_hit(hits[-1], request.block_hashes[num_blocks - 1], num_blocks)
        return tuple(hits), num_blocks * self.block_size

    @staticmethod
    def _check_state_hit(hit: list, block_hash, num_blocks: int) -> None:
        """A model with recurrent state resumes only from a checkpoint of exactly the prefix skipped:
        a hit on pages alone would resume from a state that never saw those tokens."""
        checkpoint = hit[-1] if len(hit) == num_blocks else None
        if checkpoint is None or checkpoint.block_hash != block_hash:
            raise RuntimeError(f"a prefix hit of {num_blocks} blocks has no state checkpoint that covers it")

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
        new_computed_blocks: Optional[KVCacheBlocks] = None,
        num_draft_tokens: int = 0,
    ) -> Optional[KVCacheBlocks]:
        """Pages in every group for `num_new_tokens` more tokens after the request's computed (and
        newly found cached) tokens, the last num_draft_tokens of them drafts that the step verifies.
        All or nothing: None, with nothing changed (but pages behind a sliding window, which no later
        token reads, freed), if a group cannot hold them. Returns the newly allocated blocks of each group."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        rid = request.request_id
        hits = new_computed_blocks or tuple([] for _ in self.managers)
        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        self.update_block_hashes(request)  # incremental: nothing to hash on most decode steps
        for manager in self.managers:
            manager.remove_skipped_blocks(rid, request.num_computed_tokens)
        needs = [m.get_num_blocks_to_allocate(rid, total_tokens, h) for m, h in zip(self.managers, hits)]
        if self.state_manager is not None:  # a step that verifies drafts takes a spare state slot
            spare = self.state_manager.num_spares_needed(rid, num_draft_tokens)
            if spare is None:
                return None
            needs[-1] += spare
        if any(n > m.block_pool.get_num_free_blocks() for m, n in zip(self.managers, needs)):
            return None
        if not any(needs) and not any(hits) and rid in self.managers[0].req_to_blocks:
            new = tuple([] for _ in self.managers)  # the common decode: the pages held have room
        else:
            new = tuple(m.allocate(rid, total_tokens, h) for m, h in zip(self.managers, hits))
        # Cache the blocks that this step fills, so that later requests of the same step share them:
        # within each layer every new K/V is written before any page is read.
        self._cache_full_blocks(request, min(total_tokens, request.num_tokens))
        if self.state_manager is not None:
            self.state_manager.schedule_drafts(rid, num_draft_tokens)
            if self.enable_caching:
                start = request.num_computed_tokens + num_new_computed_tokens
                self.state_manager.save_checkpoint(request, start, total_tokens)
        return new

    def rollback_drafts(self, request: Request, num_draft_tokens: int, num_accepted_tokens: int,
                        step_start: int) -> int:
        """The request's num_computed_tokens after its step (from step_start) verified num_draft_tokens
        drafts and accepted num_accepted_tokens. Paged KV drops the rejected positions (their slots are
        written again later). Recurrent state has absorbed every draft: on a rejection the step's start
        (its state slot still holds the state there, StateManager), so that the next step feeds the
        accepted tokens again; all accepted, the state the step wrote becomes the request's."""
        computed = request.num_computed_tokens - (num_draft_tokens - num_accepted_tokens)
        state = self.state_manager
        if state is None or not state.finish_drafts(request.request_id, num_accepted_tokens == num_draft_tokens,
                                                    computed):
            return computed
        state.num_rollbacks += 1
        state.num_recomputed_tokens += computed - step_start
        return step_start

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        for manager in self.managers:
            manager.cache_blocks(request.request_id, request.block_hashes, num_tokens)

    def uncache_uncomputed(self, request: Request, num_valid_tokens: int) -> None:
        """Drop the hashes of the request's blocks past `num_valid_tokens` (their KV was never written,
        e.g. the step that was to write them failed)."""
        for manager in self.managers:
            manager.uncache_from(request.request_id, num_valid_tokens)

    def uncache_block_ids(self, group_block_ids: Sequence[Iterable[int]]) -> None:
        """Drop the hashes of these pages (one id list per group), whoever holds them now."""
        for manager, block_ids in zip(self.managers, group_block_ids):
            pool = manager.block_pool
            for i in block_ids:
                pool.uncache_block(pool.blocks[i])

    def free(self, request: Request) -> None:
        # Under async scheduling a step's last token may be unknown when it is scheduled (the previous
        # step samples it), so its block is cached by the request's next allocation. The last step
        # has none: cache it here, its token known by now (and its K/V written: steps reach the
        # device in order). Checkpoints saved that way find their keys here too.
        self.update_block_hashes(request)
        self._cache_full_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        for manager in self.managers:
            manager.free(request.request_id)

    def get_state_slots(self, request: Request) -> tuple[int, int, int, int]:
        """The state slots of the request's step: see StateManager.state_slots."""
        return self.state_manager.state_slots(request)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids in each group (its block table rows)."""
        return tuple(m.req_to_block_ids.get(request_id, []) for m in self.managers)

    def num_blocks_needed(self, num_tokens: int, max_chunk: int) -> list[tuple[int, int]]:
        """(pages one request of `num_tokens` tokens holds at most, pages there are) per group."""
        return [(m.spec.max_blocks_held(num_tokens, self.block_size, max_chunk), m.block_pool.num_blocks)
                for m in self.managers]
