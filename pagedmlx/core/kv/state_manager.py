"""The recurrent-state group's slots (vLLM's MambaManager), with sparse checkpoints.

Each running request holds one block of the group's pool: its state slot, which every step reads and
writes. A checkpoint is another block that keeps the state after exactly k full blocks of a token
chain, cached under the hash of block k - 1 (the chain hash of the pages, so an equal hash means an
equal prefix). A request resumes from a checkpoint and from nothing else: without one its prefix hit
is 0. Checkpoints are saved at checkpoint positions, every `checkpoint_interval` tokens and at the
last full block of the prompt (so that the next turn of a conversation finds its history): a step
whose chunk reaches one saves the state there, its last one if it crosses several (the runner splits
that prefill segment's call at the position, so chunks need not end there: no step is added).

Speculative decoding (MambaSpec.num_speculative_blocks = 1): a request whose step verifies drafts
takes a second block for that step, its spare slot, and the step reads the state from the slot and
writes it to the spare (the state before the step stays intact, so nothing is copied). If every
draft is accepted the spare becomes the request's slot; otherwise the slot still holds the state at
the step's start, and the scheduler recomputes the step's tokens that were accepted from there
(rollback_drafts). Either way the other block goes back to the pool. The pool keeps blocks for
max_speculating spares; a step that finds none left verifies no drafts. A checkpoint
position inside a step's drafts is saved as any other, but cached only if the drafts up to it are
accepted (its key is the hash of the tokens, known once they are; a rejection uncaches it).

The blocks a step reads or writes besides the slot (the checkpoint it resumes from, the one it saves)
stay held by the request until its next allocation or its end. So no other request of the same step
can take them, and a saved checkpoint joins the prefix cache only after the step that writes it was
scheduled (steps reach the device in order). A checkpoint no request holds stays cached in the free
queue, most recently used last, until the pool hands its block out again (LRU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from pagedmlx.core.kv.block_hash import BlockHash
from pagedmlx.core.kv.block_pool import KVCacheBlock
from pagedmlx.core.kv.single_type import SingleTypeKVCacheManager
from pagedmlx.core.kv.spec import MambaSpec
from pagedmlx.request import Request


@dataclass
class StepBlock:
    """A checkpoint block the request's last scheduled step reads (resumes from) or saves."""

    block: KVCacheBlock
    num_tokens: int  # tokens of the chain the state covers
    saves: bool
    # A save's request block hashes, where its key is (or, under async scheduling, will be once the
    # step's last token is known: the previous step samples it); None once cancelled (the step will
    # not run). Its key is looked up when the block is released.
    hashes: Optional[list[BlockHash]] = None
    block_hash: Optional[BlockHash] = None  # the key it was cached under, once released

    def key(self, block_size: int) -> Optional[BlockHash]:
        i = self.num_tokens // block_size - 1
        return self.hashes[i] if self.hashes is not None and i < len(self.hashes) else None


class StateManager(SingleTypeKVCacheManager):
    def __init__(self, spec: MambaSpec, num_blocks: int, block_size: int, enable_caching: bool):
        super().__init__(spec, num_blocks, block_size, enable_caching)
        self.checkpoint_interval = spec.checkpoint_interval if enable_caching else 0
        self.num_running_slots = num_blocks - spec.max_checkpoints  # spare slots included
        self.max_spares = spec.max_speculating * spec.num_speculative_blocks
        self.spares: dict[str, KVCacheBlock] = {}  # the spare slot of each request whose step verifies drafts
        self.step_blocks: dict[str, list[StepBlock]] = {}
        # Checkpoints each live request saved: uncached again if the step that wrote one failed.
        self.saved: dict[str, list[StepBlock]] = {}
        self.num_checkpoints_saved = 0
        self.num_checkpoint_hits = 0
        self.num_rollbacks = 0  # verifying steps with a rejected draft, whose accepted tokens are computed again
        self.num_recomputed_tokens = 0

    # ---- where checkpoints go ----------------------------------------------------------------

    def _last_full_block(self, request: Request) -> int:
        """The last block boundary before the prompt's last token (which is always recomputed)."""
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def checkpoint_in(self, request: Request, start: int, end: int) -> Optional[int]:
        """The last checkpoint position in (start, end] still to be saved."""
        if not self.checkpoint_interval:
            return None
        last_full = self._last_full_block(request)
        candidates = {end // self.checkpoint_interval * self.checkpoint_interval, last_full if last_full <= end else 0}
        for pos in sorted(candidates, reverse=True):
            if start < pos and not self._saved_already(request, pos):
                return pos
        return None

    def _saved_already(self, request: Request, num_tokens: int) -> bool:
        i = num_tokens // self.block_size - 1
        return i < len(request.block_hashes) and self.block_pool.get_cached_block(request.block_hashes[i]) is not None

    # ---- the coordinator's interface -----------------------------------------------------------

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_blocks: int) -> list[Optional[KVCacheBlock]]:
        """The rightmost checkpoint within max_blocks blocks, as a hit of that many blocks whose last
        entry is the checkpoint (the others are None: a state needs nothing before it)."""
        if not self.checkpoint_interval:
            return []
        for k in range(max_blocks, 0, -1):
            block = self.block_pool.get_cached_block(block_hashes[k - 1])
            if block is not None:
                return [None] * (k - 1) + [block]
        return []

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """The previous step's checkpoint blocks are no longer read by the request: release them."""
        self._release(request_id)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[Optional[KVCacheBlock]]) -> int:
        revived = bool(new_computed_blocks) and new_computed_blocks[-1].ref_cnt == 0
        return int(request_id not in self.req_to_blocks) + int(revived)

    def allocate(self, request_id: str, num_tokens: int,
                 new_computed_blocks: Sequence[Optional[KVCacheBlock]]) -> list[KVCacheBlock]:
        """A slot for a request that has none; hold the checkpoint it resumes from for its first step."""
        if new_computed_blocks:
            checkpoint = new_computed_blocks[-1]
            self.block_pool.touch([checkpoint])  # before taking new blocks: it may be the next to evict
            self.step_blocks.setdefault(request_id, []).append(
                StepBlock(checkpoint, len(new_computed_blocks) * self.block_size, saves=False))
            self.num_checkpoint_hits += 1
        if request_id in self.req_to_blocks:
            return []
        new = self.block_pool.get_new_blocks(1)
        self.req_to_blocks[request_id] = list(new)
        self.req_to_block_ids[request_id] = [new[0].block_id]
        return new

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Nothing: states are cached only as checkpoints (save_checkpoint)."""

    def save_checkpoint(self, request: Request, start: int, end: int) -> None:
        """If the request's chunk [start, end) reaches a checkpoint position, take a block that the step
        writes the state at that position into; skipped when the chain is saved already, its tokens are
        not known yet (async scheduling: then its key is found when the block is released) or the pool
        must keep its blocks for running requests."""
        num_tokens = self.checkpoint_in(request, start, end)
        if num_tokens is None:
            return
        slots_to_come = max(self.num_running_slots - len(self.req_to_blocks) - len(self.spares), 0)
        if self.block_pool.get_num_free_blocks() < slots_to_come + 2:  # one for this, one for a revived hit
            return
        block = self.block_pool.get_new_blocks(1)[0]
        self.step_blocks.setdefault(request.request_id, []).append(
            StepBlock(block, num_tokens, True, request.block_hashes))

    def state_slots(self, request: Request) -> tuple[int, int, int, int]:
        """This step's (slot the state is read from, -1: none, it starts at position 0; slot it is
        written to: the spare if the step verifies drafts; checkpoint slot it is also saved to, or -1;
        how many of the step's tokens that checkpoint covers). Read before num_computed_tokens advances."""
        rid = request.request_id
        slot = self.req_to_block_ids[rid][0]
        spare = self.spares.get(rid)
        write = spare.block_id if spare is not None else slot
        read, save, save_len = (slot if request.num_computed_tokens > 0 else -1), -1, 0
        for sb in self.step_blocks.get(rid, ()):
            if not sb.saves:
                read = sb.block.block_id
            elif sb.hashes is not None:
                save, save_len = sb.block.block_id, sb.num_tokens - request.num_computed_tokens
        return read, write, save, save_len

    # ---- speculative decoding ------------------------------------------------------------------

    def num_spares_needed(self, request_id: str, num_draft_tokens: int) -> Optional[int]:
        """Blocks the request's step takes for a spare slot (1 if it verifies drafts and holds none);
        None when it would verify drafts but every spare the pool keeps is taken."""
        if not num_draft_tokens or request_id in self.spares:
            return 0
        return 1 if len(self.spares) < self.max_spares else None

    def schedule_drafts(self, request_id: str, num_draft_tokens: int) -> None:
        """The request's step just scheduled verifies num_draft_tokens drafts (0: none): it takes a spare
        slot for its state, so that the state before the step survives a rejection (num_spares_needed
        said there is one)."""
        if num_draft_tokens and request_id not in self.spares:
            self.spares[request_id] = self.block_pool.get_new_blocks(1)[0]
        elif not num_draft_tokens:
            self._free_spare(request_id)

    def finish_drafts(self, request_id: str, all_accepted: bool, num_valid_tokens: int) -> bool:
        """After a verifying step: if every draft was accepted, the spare slot (the state after all of
        the step's tokens) becomes the request's slot. Otherwise a checkpoint the step saved past its
        num_valid_tokens (in a rejected draft) is never cached. The other block goes back. Returns whether
        the state must be recomputed from the step's start (a draft was rejected: its slot holds the
        state there)."""
        spare = self.spares.pop(request_id, None)
        if spare is None:
            return False
        if all_accepted:
            blocks = self.req_to_blocks[request_id]
            blocks[0], spare = spare, blocks[0]
            self.req_to_block_ids[request_id][0] = blocks[0].block_id
        else:
            self.uncache_from(request_id, num_valid_tokens)
        self.block_pool.free_blocks([spare])
        return not all_accepted

    def _free_spare(self, request_id: str) -> None:
        spare = self.spares.pop(request_id, None)
        if spare is not None:
            self.block_pool.free_blocks([spare])

    def uncache_from(self, request_id: str, num_valid_tokens: int) -> None:
        """Checkpoints past num_valid_tokens were never written (the step failed or was taken back)."""
        for sb in self.step_blocks.get(request_id, ()):
            if sb.saves and sb.num_tokens > num_valid_tokens:
                sb.hashes = None
        for sb in self.saved.get(request_id, ()):
            if sb.num_tokens > num_valid_tokens and sb.block.block_hash == sb.block_hash:
                self.block_pool.uncache_block(sb.block)

    def free(self, request_id: str) -> None:
        self._free_spare(request_id)
        self._release(request_id)
        self.saved.pop(request_id, None)
        super().free(request_id)

    def _release(self, request_id: str) -> None:
        """Give back the request's checkpoint blocks; the ones its step saved join the prefix cache."""
        for sb in self.step_blocks.pop(request_id, ()):
            sb.block_hash = sb.key(self.block_size)
            if sb.block_hash is not None:
                self.block_pool.cache_block(sb.block, sb.block_hash)
                if sb.block.block_hash == sb.block_hash:  # not a duplicate of a chain saved meanwhile
                    self.saved.setdefault(request_id, []).append(sb)
                    self.num_checkpoints_saved += 1
            self.block_pool.free_blocks([sb.block])

    def held_blocks(self) -> list[list[KVCacheBlock]]:
        return [*self.req_to_blocks.values(), *([sb.block for sb in sbs] for sbs in self.step_blocks.values()),
                *([b] for b in self.spares.values())]
