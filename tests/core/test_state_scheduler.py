"""The recurrent-state group's bookkeeping under the scheduler (fake model): one slot per running
request, checkpoints saved where chunks reach checkpoint positions, found only from the next step on,
bounded and least recently used first, forgotten when the step that was to write them fails."""

from sched_utils import FakeModel, assert_no_leaks, make_request, make_scheduler
from sched_utils import run_to_completion as run

from pagedmlx.request import RequestStatus

BS, INTERVAL = 4, 8


def cached_checkpoints(sched) -> int:
    return len(sched.kv_cache_manager.state_manager.block_pool.cached_block_hash_to_block)


def test_a_chunk_saves_its_last_checkpoint_and_the_next_turn_resumes_there():
    sched = make_scheduler(num_blocks=64, max_model_len=200, state_interval=INTERVAL)
    model = FakeModel(sched)
    prompt = list(range(1, 31))  # 30 tokens: the last full block before the last token ends at 28
    sched.add_request(make_request("t1", prompt, max_tokens=3))
    out, _ = model.step()
    read, write, save, save_len = out.state_slots[0].tolist()
    assert read == -1 and save >= 0 and save_len == 28  # one chunk of 30: its last checkpoint position
    run(sched, model)
    assert cached_checkpoints(sched) == 2  # 28 (the prompt's last full block) and 32 (an interval, in decode)
    second = make_request("t2", prompt + [7, 7, 7], max_tokens=2)
    sched.add_request(second)
    out, _ = model.step()
    assert second.num_cached_tokens == 28 and out.state_slots[0, 0] >= 0  # resumes from the checkpoint's slot
    run(sched, model)
    assert_no_leaks(sched)


def test_a_checkpoint_is_found_only_after_the_step_that_writes_it():
    """Two requests with one prompt admitted in one step both compute it: the first one's checkpoint
    is written by that very step, so the second cannot resume from it."""
    sched = make_scheduler(num_blocks=64, max_model_len=200, state_interval=INTERVAL)
    model = FakeModel(sched)
    prompt = list(range(1, 20))
    for rid in "ab":
        sched.add_request(make_request(rid, prompt, max_tokens=2))
    out, _ = model.step()
    assert out.req_ids == ["a", "b"] and (out.state_slots[:, 0] == -1).all()
    assert sched.requests["b"].num_cached_tokens == 0
    sched.add_request(make_request("c", prompt, max_tokens=2))
    model.step()
    assert sched.requests["c"].num_cached_tokens == 16  # now it is there
    run(sched, model)
    assert_no_leaks(sched)


def test_checkpoints_are_bounded_and_evicted_least_recently_used_first():
    """The pool holds max_num_seqs slots plus the checkpoints' (2 + 3 here); checkpoints keep every
    block no request holds, as cached pages do, and the least recently used goes first."""
    sched = make_scheduler(num_blocks=64, max_num_seqs=2, max_model_len=200, state_interval=INTERVAL,
                           state_checkpoints=3)
    model = FakeModel(sched)
    prompts = [[100 * i + j for j in range(1, 14)] for i in range(1, 8)]  # each saves one checkpoint, at 12
    for i, prompt in enumerate(prompts):
        sched.add_request(make_request(str(i), prompt, max_tokens=1))
        run(sched, model)
        assert cached_checkpoints(sched) == min(i + 1, 4)  # one block is the slot a request takes next
    hits = []
    for i in reversed(range(len(prompts))):  # newest first: a miss saves again, evicting what is left
        again = make_request(f"again{i}", prompts[i] + [1], max_tokens=1)
        sched.add_request(again)
        run(sched, model)
        hits.append(again.num_cached_tokens)
    assert hits == [12, 12, 12, 12, 0, 0, 0]  # the oldest three were evicted
    assert_no_leaks(sched)


def test_a_failed_step_forgets_the_checkpoint_it_was_to_save():
    sched = make_scheduler(num_blocks=64, max_model_len=200, state_interval=INTERVAL)
    model = FakeModel(sched)
    prompt = list(range(1, 20))
    sched.add_request(make_request("a", prompt, max_tokens=4))
    out = sched.schedule()
    assert out.state_slots[0, 2] >= 0
    (failed,) = sched.fail_step(out)
    assert failed.status == RequestStatus.FINISHED_ERROR
    assert cached_checkpoints(sched) == 0
    sched.add_request(make_request("b", prompt + [1], max_tokens=2))
    model.step()
    assert sched.requests["b"].num_cached_tokens == 0
    run(sched, model)
    assert_no_leaks(sched)


def test_without_prefix_caching_there_are_no_checkpoints():
    sched = make_scheduler(num_blocks=64, max_model_len=200, state_interval=INTERVAL, caching=False)
    model = FakeModel(sched)
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, list(range(1, 20)), max_tokens=3))
        run(sched, model)
    assert sched.requests == {} and cached_checkpoints(sched) == 0
    assert_no_leaks(sched)
