"""Scheduler: decides, each step, which requests advance and by how many tokens.

One rule (vLLM v1): every request has num_computed_tokens and each step tries to let it catch up
with num_tokens (prompt + output so far). A 1-token catch-up is a decode, a long one a (chunked)
prefill, and a preempted request simply catches up again, mostly from its own cached pages.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

from pagedmlx.config import EngineConfig
from pagedmlx.core.kv.manager import KVCacheManager, cdiv
from pagedmlx.request import Request, RequestStatus
from pagedmlx.core.sched.output import SchedulerOutput, build_scheduler_output
from pagedmlx.multimodal.encoder_cache import EncoderCacheManager
from pagedmlx.spec_decode.metrics import SpecDecodingStats

logger = logging.getLogger("pagedmlx")


@dataclass
class RequestUpdate:
    """What one step did to one request: the tokens it appended and whether it finished."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class WaitingQueue:
    """FCFS (a deque) or priority order (a heap on priority, arrival, insertion)."""

    def __init__(self, policy: str):
        self.policy = policy
        self._fcfs: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fcfs.append(request)
        else:
            heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    def prepend(self, request: Request) -> None:
        """Put a preempted request back at the head (under priority, its own key places it)."""
        if self.policy == "fcfs":
            self._fcfs.appendleft(request)
        else:
            self.add(request)

    def peek(self) -> Request:
        return self._fcfs[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._fcfs.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fcfs.remove(request)
        else:
            self._heap = [e for e in self._heap if e[3] is not request]
            heapq.heapify(self._heap)

    def __iter__(self):
        return iter(self._fcfs) if self.policy == "fcfs" else (e[3] for e in sorted(self._heap))

    def __len__(self) -> int:
        return len(self._fcfs) if self.policy == "fcfs" else len(self._heap)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []  # in admission order (see _preemption_victim)
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.encoder_cache_manager = EncoderCacheManager(config.max_num_batched_tokens)  # images (multimodal/)
        spec = config.speculative_config
        self.spec_decoding_stats = SpecDecodingStats.new(spec.num_speculative_tokens) if spec is not None else None

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        n = request.num_prompt_tokens
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens but the context holds {self.max_model_len} "
                             f"(max_model_len), leaving no room for output")
        # Alone, a request must fit the pool at its longest (its last token is never fed back), or it
        # would preempt itself when the pool runs out and then wait forever for pages.
        max_tokens = request.sampling_params.max_tokens
        longest = self.max_model_len if max_tokens is None else min(self.max_model_len, n + max_tokens)
        chunk = self.config.max_num_batched_tokens
        for needed, have in self.kv_cache_manager.num_blocks_needed(longest - 1, chunk):
            if needed > have:
                raise ValueError(f"prompt has {n} tokens and can grow to {longest} (max_tokens={max_tokens}, "
                                 f"max_model_len={self.max_model_len}), whose KV needs {needed} blocks, but the "
                                 f"pool has only {have}")
        self.encoder_cache_manager.add_request(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string, error). Unknown ids are ignored."""
        finished = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            finished.append(req)
        return finished

    def _free(self, request: Request) -> None:
        request.structured_output_request = None  # guided decoding: its matcher goes with it
        self.encoder_cache_manager.free(request)
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    # ---- one step ----------------------------------------------------------------------------

    def _num_new_tokens(self, request: Request, budget: int, num_computed: int, cap: int) -> int:
        """Tokens to schedule for the request: its catch-up to num_tokens, and its draft tokens after
        that (speculative decoding; never behind a token still in flight), within the cap and budget."""
        if request.num_output_placeholders:
            request.spec_token_ids = []  # proposed before a token it does not know yet
            if self._reaches_length(request, request.num_output_placeholders):
                return 0  # its last token is still in flight and ends it: nothing more to compute
        n = request.num_tokens_with_placeholders + len(request.spec_token_ids) - num_computed
        uncapped = min(n, budget)
        if cap > 0:
            n = min(n, cap)
        n = min(n, budget)
        return self.encoder_cache_manager.trim(request, num_computed, n, uncapped) if request.mm_features else n

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        scheduled_ids: set[str] = set()
        preempted: list[Request] = []
        spec_decode_tokens: dict[str, list[int]] = {}  # speculative decoding: drafts verified this step
        self.encoder_cache_manager.begin_step()

        # Running requests first: decodes, then unfinished prefill chunks.
        decodes = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        prefills = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        # A prefill chunk is capped only while others decode (their inter-token latency); alone, a
        # prompt takes the whole budget: fewer, larger chunks.
        cap = self.config.long_prefill_token_threshold if decodes else 0
        for req in decodes + prefills:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._num_new_tokens(req, budget, req.num_computed_tokens, cap)
            if n <= 0:
                continue
            # Drafts past the budget or the cap are cut; all of them go before anyone is preempted.
            num_spec = max(0, n + req.num_computed_tokens - req.num_tokens_with_placeholders)
            while self.kv_cache_manager.allocate_slots(req, n, num_draft_tokens=num_spec) is None:
                if num_spec:
                    n, num_spec = n - num_spec, 0
                    continue
                victim = self._preemption_victim()  # may be one this step already scheduled
                if victim.request_id in scheduled_ids:
                    budget += self._unschedule(victim, scheduled, scheduled_ids)
                    spec_decode_tokens.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status == RequestStatus.RUNNING:
                scheduled.append((req, n))
                scheduled_ids.add(req.request_id)
                budget -= n
                if num_spec:
                    spec_decode_tokens[req.request_id] = req.spec_token_ids[:num_spec]
                req.spec_token_ids = []  # verified now or dropped: the drafter proposes afresh after the step

        # Then waiting ones, in queue order, while there is budget, room and pages. Not after a
        # preemption: the pages just freed belong to the running requests.
        # Passed over, they keep their places: guided requests whose grammar is not ready (vLLM's
        # WAITING_FOR_FSM), and requests for an adapter when max_loras others are running (as vLLM).
        compiling: list[Request] = []
        loras = self._running_loras()
        while (not preempted and budget > 0 and len(self.waiting) > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting.peek()
            if req.structured_output_request is not None and not req.structured_output_request.is_ready():
                compiling.append(self.waiting.pop())
                continue
            lora = req.lora_request.lora_int_id if req.lora_request is not None else 0
            if lora and lora not in loras and len(loras) >= self.config.max_loras:
                compiling.append(self.waiting.pop())
                continue
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(req)
            if req.mm_features and self.encoder_cache_manager.whole_images:
                limit = self.encoder_cache_manager.image_start_before(req, num_hit_tokens)
                if limit < num_hit_tokens:
                    hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(req, max_tokens=limit)
            n = self._num_new_tokens(req, budget, num_hit_tokens, cap)
            if (n <= 0 and req.mm_features) or self.kv_cache_manager.allocate_slots(
                    req, n, num_new_computed_tokens=num_hit_tokens, new_computed_blocks=hits) is None:
                break
            self.waiting.pop()
            self.kv_cache_manager.record_prefix_query(req, num_hit_tokens)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
            if lora:
                loras.add(lora)
        for req in reversed(compiling):  # back at the head, in their order
            self.waiting.prepend(req)

        kv = self.kv_cache_manager
        out = build_scheduler_output(
            scheduled, kv.get_block_ids, self.block_size, [r.request_id for r in preempted], self.finished_req_ids,
            kv.get_state_slots if kv.state_manager is not None else None, spec_decode_tokens)
        self.finished_req_ids = set()
        if scheduled and self.encoder_cache_manager.needs_update:
            out.mm_features, out.free_encoder_mm_hashes = self.encoder_cache_manager.update(scheduled)
        if scheduled and self.encoder_cache_manager.mrope_requests:
            self.encoder_cache_manager.rope_positions(out, self.requests)
        for req, n in scheduled:
            req.num_computed_tokens += n
        return out

    def _running_loras(self) -> set[int]:
        """The adapters of running requests: at most max_loras, so every step fits the LoRA slots."""
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _reaches_length(self, request: Request, extra: int = 0) -> bool:
        """Whether the request is at max_model_len or max_tokens, counting `extra` tokens in flight."""
        max_tokens = request.sampling_params.max_tokens
        return (request.num_tokens + extra >= self.max_model_len
                or (max_tokens is not None and request.num_output_tokens + extra >= max_tokens))

    def _unschedule(self, request: Request, scheduled: list[tuple[Request, int]], scheduled_ids: set[str]) -> int:
        """Take back a request scheduled earlier in this step; returns its tokens to the budget. The
        blocks its allocation cached as they would fill are uncached: this step will not write them."""
        i = next(i for i, (r, _) in enumerate(scheduled) if r is request)
        _, n = scheduled.pop(i)
        scheduled_ids.remove(request.request_id)
        self.kv_cache_manager.uncache_uncomputed(request, request.num_computed_tokens)
        return n

    def _preemption_victim(self) -> Request:
        """As vLLM: the newest running request (fcfs), or the lowest-priority one, newest among
        equals (priority: a larger `priority` value is served later)."""
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def recompute_all(self, why: str) -> None:
        """The pages' contents were lost (ModelRunner.repair_pages zeroed them): every running request is
        preempted, to recompute from its tokens (a draft model's pages with them), and every cached page forgotten."""
        running = list(self.running)
        for req in reversed(running):  # each goes to the head of the queue: the oldest ends first
            self._preempt(req)
        for pool in self.kv_cache_manager.block_pools:
            if not pool.reset_prefix_cache():
                raise RuntimeError("pages are still in use after every running request was preempted")
        logger.warning("the KV pages were lost (%s); %d running requests recompute", why, len(running))

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: free the pages (their hashes stay cached) and requeue at the head."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: Sequence[Union[int, list[int]]],
                           requests: Optional[list[Request]] = None) -> list[RequestUpdate]:
        """Append each request's sampled token (or tokens: its accepted drafts and the token after
        them, speculative decoding), check stops token by token and free finished requests. Rejected
        drafts roll back: num_computed_tokens drops to the accepted tokens (their KV slots are
        written again later; their blocks were never cached, as only blocks of known tokens are), or,
        for a model with recurrent state, to the step's start (KVCacheManager.rollback_drafts).

        With async scheduling a request may have been preempted since this step was scheduled: its
        token still counts (it recomputes from it); one that finished meanwhile drops it, and so does
        a new request that reuses its id (`requests`: the step's scheduled requests, in order)."""
        scheduled = dict(zip(output.req_ids, requests)) if requests is not None else None
        drafts = dict(zip(output.sampled_req_ids, output.num_draft_tokens)) if output.num_draft_tokens else None
        starts = (dict(zip(output.req_ids, (output.seq_lens - output.num_scheduled_tokens).tolist()))
                  if drafts is not None else None)
        updates = []
        for rid, sampled in zip(output.sampled_req_ids, sampled_token_ids):
            req = self.requests.get(rid)
            if req is None or req.is_finished or (scheduled is not None and scheduled[rid] is not req):
                continue  # aborted, already stopped, or its id now names another request
            req.num_output_placeholders = max(0, req.num_output_placeholders - 1)
            tokens = sampled if isinstance(sampled, list) else [sampled]
            num_draft = drafts[rid] if drafts is not None else 0
            if num_draft:
                num_accepted = len(tokens) - 1
                if req.status == RequestStatus.RUNNING:
                    req.num_computed_tokens = self.kv_cache_manager.rollback_drafts(req, num_draft, num_accepted,
                                                                                    starts[rid])
                self.spec_decoding_stats.observe_draft(num_draft, num_accepted)
            new_ids, finished = [], False
            for token in tokens:
                req.append_output_token(token)
                new_ids.append(token)
                if req.structured_output_request is not None:  # guided decoding: the grammar takes the token
                    req.structured_output_request.accept(token)
                finished = self._check_stop(req)
                if finished:
                    break  # the tokens after a stop are dropped
            if finished:
                if req in self.running:
                    self.running.remove(req)
                else:
                    self.waiting.remove(req)
                self._free(req)
            updates.append(RequestUpdate(req, new_ids, finished))
        return updates

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Speculative decoding: the drafter's proposals for running requests, verified next step."""
        for rid, drafts in draft_token_ids.items():
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                req.spec_token_ids = drafts

    def _check_stop(self, req: Request) -> bool:
        params = req.sampling_params
        last = req.output_token_ids[-1]
        if not params.ignore_eos and last in req.eos_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
        elif last in params.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = last
        elif req.structured_output_request is not None and (ended := req.structured_output_request.finish_status()):
            req.status = ended  # guided decoding: the grammar has ended (or a token broke it)
        elif self._reaches_length(req):
            req.status = RequestStatus.FINISHED_LENGTH
        return req.is_finished

    def fail_step(self, output: SchedulerOutput, requests: Optional[list[Request]] = None) -> list[Request]:
        """The forward pass of `output` raised: its KV was never written. Forget the hashes of the
        blocks it was to fill and finish its requests with an error (`requests`: the step's own
        request objects, so that a new request reusing an id is left alone)."""
        alive = []
        bs = self.kv_cache_manager.block_size
        for i, rid in enumerate(output.req_ids):
            computed_before = int(output.seq_lens[i]) - output.num_scheduled_tokens[i]
            req = self.requests.get(rid)
            if req is None or (requests is not None and requests[i] is not req):
                # Gone since (aborted while the step ran): its pages were freed with the hashes
                # this step was to make true. Uncaching a page that holds valid KV is harmless.
                span = slice(computed_before // bs, cdiv(int(output.seq_lens[i]), bs))
                tables = [table[i, span].tolist() for table in output.block_table]
                if len(output.state_slots):  # the state group: the checkpoint the step was to save
                    tables[-1] = [int(output.state_slots[i, 2])] if output.state_slots[i, 2] >= 0 else []
                self.kv_cache_manager.uncache_block_ids(tables)
                continue
            self.kv_cache_manager.uncache_uncomputed(req, computed_before)
            req.num_computed_tokens = min(req.num_computed_tokens, computed_before)  # so free caches none of it
            alive.append(rid)
        return self.finish_requests(alive, RequestStatus.FINISHED_ERROR)

