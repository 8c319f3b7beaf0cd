"""Shared test helpers: build a scheduler, run steps through a fake model, check page accounting.

The fake model keeps one "KV" value per pool slot of each KV cache group: the token id written
there. Each step it first writes every scheduled token at its slot (as a layer writes all new K/V
before reading pages), then reads back, through each group's block table, every key the step's
queries attend (the whole context; a sliding-window group only the window) and checks it is exactly
the request's own tokens. A block shared or revived with the wrong content, a block table pointing at
another request's page, a page freed while its window still needs it, or a stale prefix-cache entry
all show up as a mismatch here.

With a recurrent-state group, the fake state of a slot is the token sequence it has consumed: a step
checks that each request reads exactly its own prefix (nothing at position 0; a checkpoint of exactly
the prefix it skipped after a hit), and that no slot one request reads or writes in a step is written
by another request in that step. A step's draft tokens (speculative decoding) are fed and consumed
like the others: a state or checkpoint that kept a rejected draft is read back as a foreign prefix.
"""

from __future__ import annotations

import itertools
import random
from typing import Optional, Sequence

import numpy as np

from pagedmlx.config import EngineConfig
from pagedmlx.core.kv.manager import KVCacheManager, cdiv
from pagedmlx.core.kv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from pagedmlx.request import Request, RequestStatus
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.core.sched.scheduler import Scheduler
from pagedmlx.core.sched.output import SchedulerOutput

EOS = 0
_arrivals = itertools.count(1)


def make_scheduler(num_blocks: int = 16, block_size: int = 4, max_num_batched_tokens: int = 64,
                   max_num_seqs: int = 16, long_prefill_token_threshold: int = 0,
                   max_model_len: int = 64, policy: str = "fcfs", caching: bool = True,
                   window: Optional[int] = None, state_interval: Optional[int] = None,
                   state_checkpoints: int = 3, speculative_config=None) -> Scheduler:
    """window: a second KV cache group of sliding-window layers beside the full-attention one.
    state_interval: a recurrent-state group (last) with checkpoints every so many tokens (0: none)."""
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          long_prefill_token_threshold=long_prefill_token_threshold,
                          max_model_len=max_model_len, scheduling_policy=policy,
                          enable_prefix_caching=caching, speculative_config=speculative_config)
    groups = [KVCacheGroupSpec(FullAttentionSpec(), num_blocks)]
    if window is not None:
        groups.append(KVCacheGroupSpec(SlidingWindowSpec(window), num_blocks + 1))
    if state_interval is not None:  # with speculative decoding, spare slots as runner/state.py's state_group keeps
        spec = config.speculative_config
        spares = 0 if spec is None else min(max_num_seqs, spec.disable_by_batch_size)
        groups.append(KVCacheGroupSpec(MambaSpec(state_interval, state_checkpoints, int(spec is not None), spares),
                                       max_num_seqs + spares + state_checkpoints))
    manager = KVCacheManager(KVCacheConfig(block_size, groups), enable_caching=caching)
    return Scheduler(config, manager, max_model_len)


def make_request(request_id: str, prompt: Sequence[int], max_tokens: Optional[int] = 16,
                 arrival_time: Optional[float] = None, **kwargs) -> Request:
    sp_keys = {"stop_token_ids", "ignore_eos"}
    sp = SamplingParams(max_tokens=max_tokens, **{k: v for k, v in kwargs.items() if k in sp_keys})
    rest = {k: v for k, v in kwargs.items() if k not in sp_keys}
    rest.setdefault("eos_token_ids", (EOS,))
    if arrival_time is None:
        arrival_time = float(next(_arrivals))  # made in order, arrived in order
    return Request(request_id, list(prompt), sp, arrival_time=arrival_time, **rest)


class FakeModel:
    """Writes scheduled tokens into a slot array and checks every context read back through pages."""

    def __init__(self, sched: Scheduler, vocab: int = 50, seed: int = 0):
        self.sched = sched
        mgr = sched.kv_cache_manager
        paged = mgr.managers[:-1] if mgr.state_manager is not None else mgr.managers
        self.kv = [np.full(len(m.block_pool.blocks) * mgr.block_size, -1, np.int64) for m in paged]
        self.windows = [getattr(m, "sliding_window", None) for m in paged]
        self.states: dict[int, tuple[int, ...]] = {}  # state slot -> the tokens its state has consumed
        self.rng = random.Random(seed)
        self.vocab = vocab

    def execute(self, out: SchedulerOutput) -> None:
        bs = self.sched.block_size
        if out.is_empty:
            return
        drafts = out.scheduled_spec_decode_tokens
        for g, (kv, window) in enumerate(zip(self.kv, self.windows)):
            slots = out.slot_mapping[g]
            assert len(set(slots.tolist())) == len(slots), "two tokens write one slot"
            kv[slots] = out.input_ids
            for i, rid in enumerate(out.req_ids):
                req = self.sched.requests[rid]
                lo, hi = out.query_start_loc[i], out.query_start_loc[i + 1]
                seq_len = int(out.seq_lens[i])
                assert hi - lo == out.num_scheduled_tokens[i]
                tokens = req.all_token_ids + drafts.get(rid, [])
                assert out.positions[lo:hi].tolist() == list(range(seq_len - (hi - lo), seq_len))
                assert out.input_ids[lo:hi].tolist() == tokens[seq_len - (hi - lo):seq_len]
                first = 0 if window is None else max(0, seq_len - (hi - lo) - window + 1)
                pos = np.arange(first, seq_len)
                read = out.block_table[g, i, pos // bs] * bs + pos % bs
                assert kv[read].tolist() == tokens[first:seq_len], f"{rid} reads foreign KV (group {g})"
        if self.sched.kv_cache_manager.state_manager is not None:
            self._run_states(out)

    def _run_states(self, out: SchedulerOutput) -> None:
        """All reads of the step, then all writes (the runner's layers do the same per layer)."""
        assert out.state_slots.shape == (out.num_reqs, 4)
        readers: dict[int, set[str]] = {}
        writers: dict[int, str] = {}
        writes = []
        spares = self.sched.kv_cache_manager.state_manager.spares
        drafts = out.scheduled_spec_decode_tokens
        for i, rid in enumerate(out.req_ids):
            req = self.sched.requests[rid]
            read, write, save, save_len = (int(x) for x in out.state_slots[i])
            lo, hi = out.query_start_loc[i], out.query_start_loc[i + 1]
            start = int(out.seq_lens[i]) - (hi - lo)
            slot = out.block_table[-1, i, 0]
            assert (out.slot_mapping[-1, lo:hi] == slot).all()
            # a step that verifies drafts writes the spare slot, any other the request's slot
            assert write == (spares[rid].block_id if rid in drafts else slot) and (rid in drafts) == (rid in spares)
            assert (read < 0) == (start == 0), f"{rid} at {start} reads slot {read}"
            got = () if read < 0 else self.states.get(read)
            assert got == tuple(req.all_token_ids[:start]), f"{rid} resumes at {start} from a foreign state"
            readers.setdefault(read, set()).add(rid)
            for slot in {write, save} - {-1}:
                assert writers.setdefault(slot, rid) == rid, f"slot {slot}: {rid} and {writers[slot]} write it"
            assert save < 0 or 0 < save_len <= hi - lo
            fed = tuple(out.input_ids[lo:hi].tolist())  # the drafts too
            writes.append((write, got + fed))
            if save >= 0:
                writes.append((save, got + fed[:save_len]))
        for slot, rid in writers.items():  # several may resume from one checkpoint, none from a slot another writes
            assert readers.get(slot, {rid}) == {rid}, f"slot {slot}: {rid} writes what {readers[slot]} read"
        for slot, state in writes:
            self.states[slot] = state

    def sample(self, out: SchedulerOutput) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in out.sampled_req_ids]  # never EOS

    def step(self, tokens: Optional[list[int]] = None):
        out = self.sched.schedule()
        self.execute(out)
        updates = self.sched.update_from_output(out, self.sample(out) if tokens is None else tokens)
        return out, updates


def step(sched: Scheduler, tokens: Optional[list[int]] = None, token: int = 7):
    """One step without a model: every sampling request gets `token` (or `tokens`)."""
    out = sched.schedule()
    if tokens is None:
        tokens = [token] * len(out.sampled_req_ids)
    return out, sched.update_from_output(out, tokens)


def run_to_completion(sched: Scheduler, model: Optional[FakeModel] = None, max_steps: int = 1000) -> None:
    """Step the fake model until every request finished, checking the invariants after each step."""
    model = model or FakeModel(sched)
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        model.step()
        check_invariants(sched)
    raise AssertionError("requests did not finish")


def check_invariants(sched: Scheduler) -> None:
    """Page accounting that must hold between any two calls into the scheduler, in every group."""
    mgr = sched.kv_cache_manager
    assert len({frozenset(m.req_to_blocks) for m in mgr.managers}) == 1, "groups disagree on who holds pages"
    for m in mgr.managers:
        (_check_state_group if m is mgr.state_manager else _check_group)(sched, m)
    check_queues(sched)


def _check_free_queue(pool) -> None:
    queue = list(pool.free_block_queue)
    free_ids = [b.block_id for b in queue]
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0 and b is not pool.null_block}
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    hashed = [b for b in pool.blocks if b.block_hash is not None]
    assert all(pool.cached_block_hash_to_block.get(b.block_hash) is b for b in hashed)


def _check_state_group(sched: Scheduler, m) -> None:
    """Each running request holds one slot (never cached); every other reference is a checkpoint block
    its last step reads or saves, or the spare slot of its step that verifies drafts (between steps:
    none); a slot is no checkpoint and no two requests share one."""
    pool = m.block_pool
    _check_free_queue(pool)
    refs: dict[int, int] = {}
    for rid, blocks in m.req_to_blocks.items():
        assert sched.requests[rid].status == RequestStatus.RUNNING and len(blocks) == 1
        assert m.req_to_block_ids[rid] == [blocks[0].block_id] and blocks[0].block_hash is None
        refs[blocks[0].block_id] = refs.get(blocks[0].block_id, 0) + 1
    assert all(n == 1 for n in refs.values()), "two requests share a state slot"
    assert not m.spares, "a spare slot outlived its step"
    for rid, step_blocks in m.step_blocks.items():
        assert rid in m.req_to_blocks
        for sb in step_blocks:
            assert sb.block.block_id not in m.req_to_block_ids[rid]
            refs[sb.block.block_id] = refs.get(sb.block.block_id, 0) + 1
    for block in pool.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0), f"{block} has {refs.get(block.block_id, 0)} holders"


def _check_group(sched: Scheduler, m) -> None:
    pool, bs, null = m.block_pool, m.block_size, m.block_pool.null_block
    window = getattr(m, "sliding_window", None)
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    queue = list(pool.free_block_queue)
    free_ids = [b.block_id for b in queue]
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0 and b is not null}
    in_use = sum(1 for b in pool.blocks if b.ref_cnt > 0)
    assert len(free_ids) + in_use == pool.num_blocks

    # Every holder of a block, and ref counts that are exactly the number of holders.
    holders: dict[int, list[tuple[Request, int]]] = {}
    assert set(m.req_to_blocks) == set(m.req_to_block_ids)
    for rid, blocks in m.req_to_blocks.items():
        req = sched.requests[rid]
        assert req.status == RequestStatus.RUNNING, f"{req} holds pages"
        assert m.req_to_block_ids[rid] == [b.block_id for b in blocks]
        # Speculative decoding: pages taken for drafts stay after a rejection (written again later; with
        # recurrent state, from the rejected step's first token on).
        spec = sched.config.speculative_config
        max_drafts = 0 if spec is None else spec.num_speculative_tokens + (sched.kv_cache_manager.state_manager
                                                                           is not None)
        assert cdiv(req.num_computed_tokens, bs) <= len(blocks) <= cdiv(req.num_computed_tokens + max_drafts, bs), \
            f"{req} holds {len(blocks)} blocks"
        real = [b for b in blocks if b is not null]
        assert len({b.block_id for b in real}) == len(real)
        nulls = len(blocks) - len(real)
        assert all(b is null for b in blocks[:nulls]), "the null block stands only for pages before the window"
        # ... and only for pages no later query reads: the next token's window starts after them.
        assert nulls == 0 or (window is not None and nulls * bs <= req.num_computed_tokens - window + 1)
        for idx, block in enumerate(blocks[nulls:], nulls):
            holders.setdefault(block.block_id, []).append((req, idx))
    for block in pool.blocks:
        if block is null:
            continue
        held_by = holders.get(block.block_id, [])
        assert block.ref_cnt == len(held_by), f"{block} has {len(held_by)} holders"
        if len(held_by) > 1:  # shared: only through the prefix cache, at the same place in the chain
            assert block.block_hash is not None, f"{block} is shared without a hash"
            for req, idx in held_by:
                assert idx < len(req.block_hashes) and req.block_hashes[idx] == block.block_hash
                assert (idx + 1) * bs <= req.num_computed_tokens

    # The prefix-cache map and the blocks' own hashes agree both ways.
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    hashed = [b for b in pool.blocks if b.block_hash is not None]
    assert all(pool.cached_block_hash_to_block.get(b.block_hash) is b for b in hashed)
    assert len(hashed) == len(pool.cached_block_hash_to_block)


def check_queues(sched: Scheduler) -> None:
    """Every live request is in exactly one queue; waiting ones hold nothing."""
    waiting = list(sched.waiting)
    assert len({id(r) for r in waiting}) == len(waiting)
    assert {r.request_id for r in waiting}.isdisjoint(r.request_id for r in sched.running)
    assert {r.request_id for r in waiting} | {r.request_id for r in sched.running} == set(sched.requests)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in waiting)
    assert len(sched.running) <= sched.config.max_num_seqs
    if sched.config.scheduling_policy == "fcfs":
        # One queue in arrival order: admission moves its boundary right, preemption moves it left,
        # so the head of `running` is the oldest unfinished request and is never the victim.
        arrivals = [r.arrival_time for r in sched.running + waiting]
        assert arrivals == sorted(arrivals), "running + waiting is out of arrival order"


def assert_no_leaks(sched: Scheduler) -> None:
    assert not sched.has_unfinished_requests() and not sched.requests
    for m in sched.kv_cache_manager.managers:
        pool = m.block_pool
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert pool.get_num_free_blocks() == pool.num_blocks == len(list(pool.free_block_queue))
        assert not m.req_to_blocks and not m.req_to_block_ids and not m.num_cached_blocks
        assert not getattr(m, "step_blocks", None) and not getattr(m, "saved", None)
