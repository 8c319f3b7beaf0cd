"""1,000 requests through a small pool with a fake model: all finish, in bounded steps, no leaks."""

import random

from sched_utils import FakeModel, assert_no_leaks, check_invariants, make_request, make_scheduler

from pagedmlx.request import RequestStatus

BLOCK_SIZE = 4
NUM_BLOCKS = 40  # 160 slots: far fewer than 8 running requests want, so preemption is frequent
MAX_NUM_SEQS = 8
CAP = 8  # long_prefill_token_threshold
BUDGET = MAX_NUM_SEQS * CAP  # enough that the oldest request always gets a full chunk (see the bound)


def make_requests(rng: random.Random, n: int):
    prefixes = [[rng.randrange(1, 1000) for _ in range(rng.randrange(4, 25))] for _ in range(6)]
    requests = []
    for i in range(n):
        prefix = rng.choice(prefixes) if rng.random() < 0.7 else []
        prompt = prefix + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 25))]
        requests.append(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 41), arrival_time=float(i)))
    return requests


def test_a_thousand_requests_through_a_small_pool():
    rng = random.Random(1234)
    sched = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET,
                           max_num_seqs=MAX_NUM_SEQS, long_prefill_token_threshold=CAP, max_model_len=160)
    model = FakeModel(sched, vocab=1000, seed=99)  # random sampled tokens, never EOS
    requests = make_requests(rng, 1000)
    # The bound. Under FCFS, running + waiting is one queue in arrival order and its head, the oldest
    # unfinished request, is never preempted (the victim is the newest; alone, any accepted request
    # fits the pool). With BUDGET >= MAX_NUM_SEQS * CAP it gets a full chunk (or all it needs) every
    # step: a step that does not sample for it computes CAP of its at most prompt + max_tokens - 1
    # positions, and it samples at most max_tokens times. Charging each step to the head of the
    # queue gives the bound below: what one-at-a-time service would take.
    bound = sum(r.sampling_params.max_tokens + (r.num_prompt_tokens + r.sampling_params.max_tokens - 1) // CAP
                for r in requests)

    pending = list(requests)
    steps = 0
    while pending or sched.has_unfinished_requests():
        for req in pending[:3]:  # three arrivals per step
            sched.add_request(req)
        del pending[:3]
        head = sched.running[0] if sched.running else None
        out, updates = model.step()
        steps += 1
        assert head is None or head.request_id not in out.preempted_req_ids, "the oldest request was preempted"
        assert not out.is_empty
        check_invariants(sched)
        assert steps <= bound, f"not done after {steps} steps"

    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    assert [r.num_output_tokens for r in requests] == [r.sampling_params.max_tokens for r in requests]
    assert_no_leaks(sched)
    stats = sched.kv_cache_manager.stats
    assert sched.num_preemptions > 50 and stats.preempted_hits > 0  # the pool was really too small
    assert stats.hits > 0  # shared prefixes were shared
    assert steps < bound / 3  # and batching did its job: far below one-at-a-time
