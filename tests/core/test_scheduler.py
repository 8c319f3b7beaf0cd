"""Scheduler: budgets, chunked prefill, preemption, aborts, stops, the step's arrays, fail_step."""

import numpy as np
import pytest
from sched_utils import (EOS, FakeModel, assert_no_leaks, check_invariants, make_request, make_scheduler,
                         run_to_completion, step)

from pagedmlx.request import Request, RequestStatus
from pagedmlx.core.sched.scheduler import Scheduler


def scheduled(out):
    return list(zip(out.req_ids, out.num_scheduled_tokens))


# ---- budgets and chunking ------------------------------------------------------------------------

def test_token_budget_is_respected_and_filled_in_order():
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=16)
    for rid, base in (("a", 100), ("b", 200), ("c", 300)):
        sched.add_request(make_request(rid, range(base, base + 10)))
    out, _ = step(sched)
    assert scheduled(out) == [("a", 10), ("b", 6)]
    assert [r.request_id for r in sched.waiting] == ["c"]
    out, _ = step(sched)
    assert scheduled(out) == [("a", 1), ("b", 4), ("c", 10)]
    assert out.total_num_scheduled_tokens == 15
    out, _ = step(sched)
    assert scheduled(out) == [("a", 1), ("b", 1), ("c", 1)]


def test_chunked_prefill_under_a_small_budget():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    sched.add_request(make_request("a", range(1, 24)))  # 23 tokens
    sizes, sampled = [], []
    for _ in range(4):
        out, updates = step(sched)
        sizes.append(out.num_scheduled_tokens[0])
        sampled.append((out.sampled_req_ids, out.logits_indices.tolist(), len(updates)))
    assert sizes == [8, 8, 7, 1]
    assert sampled == [([], [], 0), ([], [], 0), (["a"], [6], 1), (["a"], [0], 1)]


def test_long_prefill_threshold_caps_each_request_chunk_while_others_decode():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=100, long_prefill_token_threshold=5)
    sched.add_request(make_request("d", [9]))  # decodes from its second step on
    step(sched)
    sched.add_request(make_request("a", range(1, 13)))  # 12 tokens
    sched.add_request(make_request("b", range(20, 27)))  # 7 tokens
    history = [scheduled(step(sched)[0]) for _ in range(4)]
    assert history == [
        [("d", 1), ("a", 5), ("b", 5)],
        [("d", 1), ("a", 5), ("b", 2)],
        [("d", 1), ("b", 1), ("a", 2)],  # b decodes, a's last chunk
        [("d", 1), ("a", 1), ("b", 1)],
    ]


def test_prompts_alone_take_the_whole_budget():
    """No decode to protect: no per-request cap, only the token budget (fewer, larger chunks)."""
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=16, long_prefill_token_threshold=5)
    sched.add_request(make_request("a", range(1, 13)))  # 12 tokens
    sched.add_request(make_request("b", range(20, 27)))  # 7 tokens
    assert scheduled(step(sched)[0]) == [("a", 12), ("b", 4)]
    assert scheduled(step(sched)[0]) == [("a", 1), ("b", 3)]  # a decodes now: b's chunk is capped


def test_decodes_are_scheduled_before_prefill_chunks():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=5, long_prefill_token_threshold=2)
    sched.add_request(make_request("d", [9]))  # decoding throughout: prefill chunks stay capped
    step(sched, [4])
    sched.add_request(make_request("a", range(10, 20)))  # older, a long prompt
    sched.add_request(make_request("b", [5, 6]))
    out, _ = step(sched, [4, 7])
    assert scheduled(out) == [("d", 1), ("a", 2), ("b", 2)]
    assert [r.request_id for r in sched.running] == ["d", "a", "b"]
    # b is newer but decodes: it goes first, in the loop and in the batch.
    out, _ = step(sched, [4, 8])
    assert scheduled(out) == [("d", 1), ("b", 1), ("a", 2)]
    assert out.num_decodes == 2
    assert out.input_ids.tolist() == [4, 7, 12, 13]
    assert out.positions.tolist() == [2, 2, 2, 3]
    assert out.logits_indices.tolist() == [0, 1] and out.sampled_req_ids == ["d", "b"]


def test_max_num_seqs():
    sched = make_scheduler(num_blocks=16, max_num_seqs=2)
    sched.add_request(make_request("a", [1, 2], max_tokens=1))
    sched.add_request(make_request("b", [3, 4], max_tokens=3))
    sched.add_request(make_request("c", [5, 6], max_tokens=1))
    out, updates = step(sched)
    assert out.req_ids == ["a", "b"] and [r.request_id for r in sched.waiting] == ["c"]
    assert [(u.request.request_id, u.finished) for u in updates] == [("a", True), ("b", False)]
    out, _ = step(sched)
    assert scheduled(out) == [("b", 1), ("c", 2)]
    assert out.finished_req_ids == {"a"}


def test_empty_step():
    sched = make_scheduler()
    out, updates = step(sched)
    assert out.is_empty and updates == [] and out.total_num_scheduled_tokens == 0
    assert out.query_start_loc.tolist() == [0]


# ---- the step's arrays ---------------------------------------------------------------------------

def test_scheduler_output_arrays_for_a_hand_built_step():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=6)
    sched.add_request(make_request("a", [10, 11, 12, 13, 14]))
    out, _ = step(sched, [15])
    assert scheduled(out) == [("a", 5)] and sched.kv_cache_manager.get_block_ids("a") == ([0, 1],)
    # b shares a's first block (a prefix hit); c's prompt only partly fits the budget.
    sched.add_request(make_request("b", [10, 11, 12, 13, 20, 21, 22]))
    sched.add_request(make_request("c", [30, 31, 32, 33, 34]))
    out = sched.schedule()
    assert out.req_ids == ["a", "b", "c"]
    assert out.num_scheduled_tokens == [1, 3, 2]
    assert out.num_decodes == 1
    assert out.input_ids.tolist() == [15, 20, 21, 22, 30, 31]
    assert out.positions.tolist() == [5, 4, 5, 6, 0, 1]
    assert out.slot_mapping.tolist()[0] == [1 * 4 + 1, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 3 * 4 + 0, 3 * 4 + 1]
    assert out.query_start_loc.tolist() == [0, 1, 4, 6]
    assert out.seq_lens.tolist() == [6, 7, 2]
    assert out.block_table.tolist() == [[[0, 1], [0, 2], [3, 0]]]  # one KV cache group
    assert out.logits_indices.tolist() == [0, 3]
    assert out.sampled_req_ids == ["a", "b"]
    assert out.preempted_req_ids == [] and out.finished_req_ids == set()
    for arr in (out.input_ids, out.positions, out.slot_mapping, out.query_start_loc, out.seq_lens,
                out.block_table, out.logits_indices):
        assert arr.dtype == np.int32
    assert sched.requests["b"].num_cached_tokens == 4
    assert [r.num_computed_tokens for r in sched.running] == [6, 7, 2]


# ---- preemption ----------------------------------------------------------------------------------

def test_preemption_takes_the_newest_request_which_resumes_from_its_own_pages():
    sched = make_scheduler(num_blocks=5, block_size=4)
    model = FakeModel(sched)
    a = make_request("a", range(1, 8), max_tokens=4)  # 7 tokens
    b = make_request("b", range(11, 18), max_tokens=4)
    c = make_request("c", range(21, 28), max_tokens=1)
    for r in (a, b, c):
        sched.add_request(r)
    out, _ = model.step()
    assert scheduled(out) == [("a", 7), ("b", 7)]  # 4 blocks: c does not fit
    out, _ = model.step()
    assert scheduled(out) == [("a", 1), ("b", 1)]  # positions 7: no new block
    out, _ = model.step()  # both need a third block; one is free
    assert scheduled(out) == [("a", 1)]
    assert out.preempted_req_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # back at the head
    assert sched.num_preemptions == 1
    check_invariants(sched)
    # No output is lost; b's two full blocks stay cached while free.
    assert b.num_output_tokens == 2 and b.num_tokens == 9
    assert [blk.block_hash is not None for blk in sched.kv_cache_manager.block_pool.blocks[2:4]] == [True, True]
    out, _ = model.step()  # a finishes; b cannot fit yet (2 hits + 1 new > 2 free)
    assert scheduled(out) == [("a", 1)] and a.status == RequestStatus.FINISHED_LENGTH
    out, _ = model.step()
    assert scheduled(out)[0] == ("b", 1)  # 8 of its 9 tokens found in its own pages
    assert b.num_cached_tokens == 0 and sched.kv_cache_manager.get_block_ids("b")[0][:2] == [2, 3]
    stats = sched.kv_cache_manager.stats
    assert (stats.preempted_queries, stats.preempted_hits) == (9, 8)
    assert (stats.queries, stats.hits) == (21, 0)  # a, b, c fresh: not flattered by b's rehits
    run_to_completion(sched, model)
    assert b.num_output_tokens == 4 and c.num_output_tokens == 1
    assert_no_leaks(sched)


def test_the_victim_is_the_newest_request_even_when_it_was_already_scheduled():
    """An older request's prefill chunk that runs out of pages preempts the newest request, even
    though the newest (a decode) was scheduled earlier in the same step: it is taken back from the
    step. (Before the fix the older request preempted itself, and a long prompt could be pushed out
    again and again by the short requests admitted after it.)"""
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=9,
                           long_prefill_token_threshold=4, max_model_len=32)
    model = FakeModel(sched)
    c = make_request("c", [50, 51, 52, 53], max_tokens=12)  # decoding throughout: a's chunks stay capped
    sched.add_request(c)
    model.step()
    a = make_request("a", range(100, 128), max_tokens=2)  # 28 tokens: 7 blocks
    b = make_request("b", [1, 2, 3], max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    history = []
    for _ in range(6):
        out, _ = model.step()
        check_invariants(sched)
        history.append((scheduled(out), out.preempted_req_ids))
    assert history[:5] == [([("c", 1), ("a", 4), ("b", 3)], [])] + [([("c", 1), ("b", 1), ("a", 4)], [])] * 4
    # Step 6: b's decode completes its second block, a's chunk needs the pool's last page.
    assert history[5] == ([("c", 1), ("a", 4)], ["b"])
    assert b.status == RequestStatus.PREEMPTED and b.num_output_tokens == 5  # no token this step
    assert a.num_computed_tokens == 24
    # b's second block was cached for a step that then did not run for b: it must not be found.
    probe = make_request("probe", b.all_token_ids[:8] + [0])
    assert sched.kv_cache_manager.get_computed_blocks(probe)[1] == 4
    run_to_completion(sched, model)
    assert a.num_output_tokens == 2 and b.num_output_tokens == 20 and c.num_output_tokens == 12
    assert_no_leaks(sched)


def test_a_victim_taken_back_from_the_step_leaves_no_unwritten_block_in_the_cache():
    """Found by random search. r1, resumed after a preemption, catches up with a chunk that fills one
    block and starts the next; the older r3's chunk then runs out of pages and r1, the newest, is
    taken back from the step. r1's partial block goes to the front of the free queue and is what r3
    gets, so r1's newly filled block survives in the free queue: had it kept its hash, r1 would find
    it on resume and read a slot nobody wrote."""
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=8,
                           long_prefill_token_threshold=3, max_model_len=24, max_num_seqs=3)
    model = FakeModel(sched)
    arrivals = {2: [("r0", 12, 12)], 6: [("r2", 4, 7), ("r3", 18, 3)], 9: [("r1", 1, 12)]}
    reqs = {}
    for t in range(200):
        for rid, prompt_len, max_tokens in arrivals.get(t, []):
            reqs[rid] = make_request(rid, [100 * len(reqs) + j for j in range(prompt_len)], max_tokens=max_tokens)
            sched.add_request(reqs[rid])
        if t > 9 and not sched.has_unfinished_requests():
            break
        model.step()
        check_invariants(sched)
    assert reqs["r1"].num_preemptions >= 2
    assert [r.num_output_tokens for r in reqs.values()] == [12, 7, 3, 12]
    assert_no_leaks(sched)


# ---- abort and stops -----------------------------------------------------------------------------

def test_abort_waiting_and_running_requests_frees_their_pages():
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.add_request(make_request("a", range(1, 9), max_tokens=4))  # 2 blocks, 3 from its first decode
    sched.add_request(make_request("b", range(20, 28), max_tokens=4))
    sched.add_request(make_request("c", range(30, 38), max_tokens=4))
    step(sched)
    assert [r.request_id for r in sched.running] == ["a", "b"]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    finished = sched.finish_requests(["a", "c", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in finished] == ["a", "c"]
    assert [r.status.finish_reason for r in finished] == ["abort", "abort"]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 2
    assert [r.request_id for r in sched.running] == ["b"] and len(sched.waiting) == 0
    assert sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []  # already gone
    check_invariants(sched)
    out, _ = step(sched)
    assert out.finished_req_ids == {"a", "c"}
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert_no_leaks(sched)


def test_update_ignores_a_request_aborted_after_it_was_scheduled():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3]))
    out = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, [5]) == []
    assert_no_leaks(sched)


@pytest.mark.parametrize("kwargs, tokens, status, reason, stop_reason", [
    ({}, [5, EOS, 6], RequestStatus.FINISHED_STOPPED, "stop", None),
    ({"stop_token_ids": [9]}, [5, 9, 6], RequestStatus.FINISHED_STOPPED, "stop", 9),
    ({"ignore_eos": True}, [5, EOS, 6, 7, 8], RequestStatus.FINISHED_LENGTH, "length", None),
    ({"ignore_eos": True, "stop_token_ids": [EOS]}, [5, EOS, 6], RequestStatus.FINISHED_STOPPED, "stop", EOS),
    ({}, [5, 6, 7, 8, 9], RequestStatus.FINISHED_LENGTH, "length", None),
])
def test_stop_conditions(kwargs, tokens, status, reason, stop_reason):
    sched = make_scheduler(max_model_len=64)
    req = make_request("a", [1, 2, 3], max_tokens=4, **kwargs)
    sched.add_request(req)
    finished_at = None
    for i, token in enumerate(tokens):
        if req.is_finished:
            break
        _, updates = step(sched, [token])
        assert [u.new_token_ids for u in updates] == [[token]]
        if updates[0].finished:
            finished_at = i
    expected_outputs = tokens[:finished_at + 1]
    assert req.output_token_ids == expected_outputs
    assert len(expected_outputs) == (2 if status == RequestStatus.FINISHED_STOPPED else 4)
    assert (req.status, req.status.finish_reason, req.stop_reason) == (status, reason, stop_reason)
    assert_no_leaks(sched)


def test_max_model_len_ends_a_request():
    sched = make_scheduler(max_model_len=8)
    req = make_request("a", range(1, 7), max_tokens=None)
    sched.add_request(req)
    _, u1 = step(sched)
    _, u2 = step(sched)
    assert [u.finished for u in u1 + u2] == [False, True]
    assert req.num_tokens == 8 and req.status == RequestStatus.FINISHED_LENGTH
    assert_no_leaks(sched)


def test_prompts_that_can_never_fit_are_refused():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("a", range(32), max_tokens=1))
    with pytest.raises(ValueError, match="pool"):
        sched.add_request(make_request("b", range(17), max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("c", [1], max_tokens=1))
        sched.add_request(make_request("c", [1], max_tokens=1))
    with pytest.raises(ValueError, match="at least one token"):
        make_request("d", [])
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_a_request_whose_output_cannot_fit_the_pool_is_refused_not_left_hanging():
    """16 KV slots: a prompt of 10 may produce 7 tokens (the last one is never fed back), not 8.
    Without the check the request preempts itself when the pool runs out, and then every later
    step schedules nothing while it waits forever for pages that cannot exist."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="pool"):
        sched.add_request(make_request("a", range(10), max_tokens=8))
    with pytest.raises(ValueError, match="pool"):
        sched.add_request(make_request("b", range(10), max_tokens=None))  # up to max_model_len
    ok = make_request("c", range(10), max_tokens=7)
    sched.add_request(ok)
    run_to_completion(sched)
    assert ok.num_output_tokens == 7
    short = make_scheduler(num_blocks=4, block_size=4, max_model_len=17)
    fits = make_request("d", range(10), max_tokens=None)  # max_model_len caps it at 7 outputs
    short.add_request(fits)
    run_to_completion(short)
    assert fits.num_output_tokens == 7 and fits.status == RequestStatus.FINISHED_LENGTH


# ---- policy and failures -------------------------------------------------------------------------

def test_priority_policy_orders_waiting_requests():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    for rid, prio, t in (("low", 2, 1.0), ("hi-late", 0, 4.0), ("mid", 1, 2.0), ("hi-early", 0, 3.0)):
        sched.add_request(make_request(rid, [1, 2], max_tokens=1, priority=prio, arrival_time=t))
    assert [r.request_id for r in sched.waiting] == ["hi-early", "hi-late", "mid", "low"]
    order = [step(sched)[0].req_ids[0] for _ in range(4)]
    assert order == ["hi-early", "hi-late", "mid", "low"]
    fcfs = make_scheduler(policy="fcfs")
    for rid, prio in (("x", 2), ("y", 0)):
        fcfs.add_request(make_request(rid, [1], priority=prio))
    assert [r.request_id for r in fcfs.waiting] == ["x", "y"]


def test_priority_policy_preempts_the_lowest_priority_first():
    """As vLLM: under "priority" the victim is the running request with the largest priority value
    (newest among equals), not simply the newest; under fcfs it is the newest."""
    for policy, victim in (("priority", "low"), ("fcfs", "hi")):
        sched = make_scheduler(policy=policy, num_blocks=6, block_size=4)
        for rid, prio, t in (("low", 5, 1.0), ("mid", 1, 2.0), ("hi", 0, 3.0)):
            sched.add_request(make_request(rid, range(1, 8), max_tokens=10, priority=prio, arrival_time=t))
        step(sched)  # all three admitted: 2 blocks each, the pool is full
        assert len(sched.running) == 3
        while not sched.num_preemptions:  # decodes soon need a third block each: someone must go
            step(sched)
        assert [r.request_id for r in sched.waiting][:1] == [victim], policy
        assert victim not in {r.request_id for r in sched.running}


def _first_chunk_done(prompt: list[int]) -> tuple[Scheduler, Request]:
    """A scheduler whose request "a" has run its first 5-token chunk (block 0 valid and cached)."""
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=5)
    a = make_request("a", prompt)
    sched.add_request(a)
    FakeModel(sched).step()
    sched.config.max_num_batched_tokens = 10  # the next step has room for a second request
    return sched, a


def test_fail_step_uncaches_the_blocks_the_failed_step_was_to_fill():
    prompt = list(range(1, 11))
    sched, a = _first_chunk_done(prompt)
    mgr = sched.kv_cache_manager
    assert mgr.get_computed_blocks(make_request("p1", prompt))[1] == 4
    sched.add_request(make_request("b", prompt))
    out = sched.schedule()
    # a fills block 1 this step; b, in the same step, shares blocks 0 and 1 through the cache.
    assert scheduled(out) == [("a", 5), ("b", 2)]
    assert out.block_table.tolist() == [[[0, 1, 2], [0, 1, 3]]]
    assert mgr.get_computed_blocks(make_request("p2", prompt))[1] == 8
    failed = sched.fail_step(out)  # the forward pass raised: nothing was written
    assert [r.request_id for r in failed] == ["a", "b"]
    assert all(r.status == RequestStatus.FINISHED_ERROR and r.status.finish_reason == "error" for r in failed)
    assert mgr.get_computed_blocks(make_request("p3", prompt))[1] == 4  # block 0 is still good
    assert [blk.block_id for blk in mgr.block_pool.blocks if blk.block_hash is not None] == [0]
    assert_no_leaks(sched)


def test_fail_step_uncaches_the_blocks_of_a_request_aborted_while_the_step_ran():
    """Async engine: step N is in flight, its request is aborted (pages freed, hashes kept), then
    step N fails. The pages it was to fill must not stay in the prefix cache with garbage KV."""
    prompt = list(range(1, 11))
    sched, a = _first_chunk_done(prompt)
    mgr = sched.kv_cache_manager
    out = sched.schedule()  # a fills block 1 (tokens 4..7) this step
    assert scheduled(out) == [("a", 5)] and mgr.get_computed_blocks(make_request("p", prompt))[1] == 8
    assert [r.request_id for r in sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)] == ["a"]
    assert sched.fail_step(out, [a]) == []  # nobody left to fail ...
    assert mgr.get_computed_blocks(make_request("p2", prompt))[1] == 4  # ... but block 1 is forgotten
    assert [blk.block_id for blk in mgr.block_pool.blocks if blk.block_hash is not None] == [0]
    assert_no_leaks(sched)
