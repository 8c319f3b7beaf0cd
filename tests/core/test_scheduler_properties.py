"""Random interleavings of add / resubmit / step / finish / abort / failed steps against a tiny pool.

After every operation the page accounting must hold (see sched_utils.check_invariants), every
context the fake model reads back through the pages must be the request's own tokens, and once
everything has drained every ref count must be 0.
"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from sched_utils import EOS, FakeModel, assert_no_leaks, check_invariants, make_request, make_scheduler

from pagedmlx.request import RequestStatus

# A few shared beginnings, so that prompts share cached blocks at different depths.
PREFIXES = [[], [1, 2, 3, 1, 2, 3], [1, 2, 3, 1, 3, 3, 2, 2], [2, 2, 2, 2, 2]]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(8, 16), block_size=st.integers(2, 4), budget=st.integers(1, 24),
                cap=st.integers(0, 8), max_seqs=st.integers(1, 6), caching=st.booleans(),
                policy=st.sampled_from(["fcfs", "priority"]), seed=st.integers(0, 2**16),
                window=st.sampled_from([None, None, 2, 3, 6]), state=st.sampled_from([None, None, 0, 1, 2]),
                checkpoints=st.integers(0, 4))
    def setup(self, num_blocks, block_size, budget, cap, max_seqs, caching, policy, seed, window, state,
              checkpoints):
        """window: a sliding-window group beside the full-attention one (a hybrid model's pages);
        state: a recurrent-state group, with checkpoints every `state` blocks (0: none)."""
        # max_model_len = the pool's size: every request it accepts fits alone, so all can finish.
        self.max_model_len = num_blocks * block_size
        self.sched = make_scheduler(num_blocks, block_size, budget, max_seqs, cap, self.max_model_len,
                                    policy, caching, window, None if state is None else state * block_size,
                                    checkpoints)
        self.model = FakeModel(self.sched, vocab=4, seed=seed)  # tiny vocab: outputs collide, blocks are shared
        self.counter = 0
        self.live = {}
        self.all_requests = []
        self.ended = []  # requests finished from outside (abort, stop string) or by a failed step

    @rule(batch=st.lists(st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(1, 3), max_size=14),
                                   st.integers(1, 16), st.sampled_from([None, None, "s"]), st.integers(0, 2)),
                         min_size=1, max_size=3))
    def add(self, batch):
        for prefix, suffix, max_tokens, salt, priority in batch:
            self._add((prefix + suffix) or [3], max_tokens, salt, priority)

    @precondition(lambda self: self.all_requests)
    @rule(data=st.data(), max_tokens=st.integers(1, 16))
    def resubmit(self, data, max_tokens):
        """A prompt that repeats an earlier request's tokens (outputs included): it hits whatever that
        request left in the cache, so a block cached with KV that was never written is read back."""
        old = data.draw(st.sampled_from(self.all_requests))
        length = data.draw(st.integers(1, old.num_tokens))
        self._add(old.all_token_ids[:length], max_tokens, old.cache_salt, old.priority)

    def _add(self, prompt, max_tokens, salt, priority):
        self.counter += 1
        req = make_request(f"r{self.counter}", prompt, max_tokens=max_tokens, cache_salt=salt,
                           priority=priority, arrival_time=float(self.counter))
        if len(prompt) >= self.max_model_len:
            with pytest.raises(ValueError, match="max_model_len"):
                self.sched.add_request(req)
            return
        self.sched.add_request(req)
        self.live[req.request_id] = req
        self.all_requests.append(req)

    @rule(times=st.integers(1, 4))
    def step(self, times):
        for _ in range(times):
            out, updates = self.model.step()
            self._check_updates(out, updates)
            check_invariants(self.sched)

    @rule()
    def step_sampling_eos(self):
        out = self.sched.schedule()
        self.model.execute(out)
        tokens = self.model.sample(out)
        tokens[:1] = [EOS] * len(tokens[:1])
        updates = self.sched.update_from_output(out, tokens)
        self._check_updates(out, updates)
        if updates:
            assert updates[0].finished and updates[0].request.status == RequestStatus.FINISHED_STOPPED

    @precondition(lambda self: self.live)
    @rule(data=st.data(), status=st.sampled_from([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED]))
    def finish_from_outside(self, data, status):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        (req,) = self.sched.finish_requests([rid], status)
        assert req.status == status
        self.ended.append(req)
        del self.live[rid]

    @rule()
    def failed_step(self):
        out = self.sched.schedule()
        failed = self.sched.fail_step(out)  # nothing is written to the fake KV
        assert sorted(r.request_id for r in failed) == sorted(out.req_ids)
        for req in failed:
            assert req.status == RequestStatus.FINISHED_ERROR
            self.ended.append(req)
            del self.live[req.request_id]

    def _check_updates(self, out, updates):
        assert [u.request.request_id for u in updates] == out.sampled_req_ids
        for u in updates:
            req = u.request
            assert req.output_token_ids[-1:] == u.new_token_ids
            assert u.finished == req.is_finished
            if u.finished:
                del self.live[req.request_id]
                if req.status == RequestStatus.FINISHED_LENGTH:
                    assert (req.num_output_tokens == req.sampling_params.max_tokens
                            or req.num_tokens == self.max_model_len)
                    assert req.num_output_tokens <= req.sampling_params.max_tokens
                else:
                    assert req.output_token_ids[-1] == EOS and req.status == RequestStatus.FINISHED_STOPPED

    @invariant()
    def accounting_holds(self):
        if hasattr(self, "sched"):
            check_invariants(self.sched)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # Drain: everything still live must finish. A one-at-a-time run with a budget of one token
        # would take sum(prompt + max_tokens) steps; allow ten times that before calling it a livelock.
        limit = 10 * sum(r.num_prompt_tokens + r.sampling_params.max_tokens for r in self.live.values()) + 10
        for _ in range(limit):
            if not self.sched.has_unfinished_requests():
                break
            out, updates = self.model.step()
            self._check_updates(out, updates)
            check_invariants(self.sched)
        assert not self.live, f"{len(self.live)} requests did not finish in {limit} steps"
        assert_no_leaks(self.sched)
        assert all(r.is_finished for r in self.ended)


SchedulerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase
