"""EngineCore: the step loop (schedule -> forward -> sample -> update -> token ids out).

`step` runs one step in lockstep with the device; `step_with_batch_queue` (vLLM's name) schedules
and builds step N+1 while step N runs. The core sees token ids only: text (detokenizing, stop
strings) is the OutputProcessor's, in the caller's thread (engine/llm_engine.py, offline) or in the server's
front-end process (engine/core_proc.py runs this class in a process of its own)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from pagedmlx.platform import warn_if_slow_blas
from pagedmlx.config import EngineConfig
from pagedmlx.engine.input_checks import check_logit_bias, check_token_ids
from pagedmlx.engine.prompt_logprobs import prompt_logprobs, record_prompt_logprobs
from pagedmlx.engine.step import LaunchedStep, StepStats
from pagedmlx.kernels.check import error_line
from pagedmlx.core.kv.manager import KVCacheManager
from pagedmlx.lora.request import LoRARequest
from pagedmlx.multimodal.engine import attach_encoder, check_mm_request
from pagedmlx.outputs import EngineCoreOutput, TokenLogprob
from pagedmlx.request import Request, RequestStatus
from pagedmlx.runner.kv_budget import DEFAULT_MAX_MODEL_LEN, max_model_len
from pagedmlx.runner.model import ModelRunner, PagesLost, weights_nbytes
from pagedmlx.sample.sampler import Sampler, to_host
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.core.sched.scheduler import Scheduler
from pagedmlx.core.sched.output import SchedulerOutput
from pagedmlx.spec_decode.mtp_proposer import make_proposer
from pagedmlx.spec_decode.drafter import make_drafter
from pagedmlx.sample.rejection_sampler import verify
from pagedmlx.structured_outputs.manager import StructuredOutputManager

logger = logging.getLogger("pagedmlx")

__all__ = ["DEFAULT_MAX_MODEL_LEN", "EngineCore", "LaunchedStep", "StepStats"]


class EngineCore:
    def __init__(self, model: nn.Module, tokenizer: Any, config: Optional[EngineConfig] = None,
                 verify_model: bool = True, model_identity: Optional[str] = None, mm_encoder: Any = None):
        self.config, self.model, self.tokenizer = config or EngineConfig(), model, tokenizer
        self.model_identity = model_identity  # what names the weights: their check may be kept (runner/check_cache.py)
        warn_if_slow_blas()  # MLX's reference BLAS on the CPU: the fix, in one line
        if self.config.dtype is not None:  # quantized weights keep their packed form
            model.set_dtype(getattr(mx, self.config.dtype))
        self.draft_proposer, self._draft_tokenizer = make_proposer(self.config, verify_model, model)  # or None
        self.runner = self.make_runner(verify_model)
        self.mm_encoder = attach_encoder(self.runner, mm_encoder)  # images (pagedmlx/multimodal/), or None
        self.keeps_hidden = hasattr(self.draft_proposer, "observe_step")  # an MTP module reads the hidden states
        if self.keeps_hidden:
            if not isinstance(self.runner, ModelRunner):
                raise ValueError("speculative_config.method 'mtp' is not served with tensor parallelism yet")
            self.runner.keep_hidden = True
        self.lora_manager = getattr(self.runner, "lora_manager", None)  # batched LoRA (pagedmlx/lora/)
        if self.config.enable_lora and self.lora_manager is None:
            raise ValueError("enable_lora is not supported with tensor parallelism yet")
        if self.lora_manager is not None:
            self.lora_manager.in_use = self._loras_in_use
        self.max_model_len = max_model_len(self.config, self.model, self.runner.kv_cache_config)
        self.kv_cache_manager = KVCacheManager(self.runner.kv_cache_config,
                                               enable_caching=self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.kv_cache_manager, self.max_model_len)
        self.scheduler.encoder_cache_manager.whole_images = bool(getattr(self.mm_encoder, "bidirectional", False))
        self.sampler = Sampler()
        self.eos_token_ids = tuple(sorted(getattr(tokenizer, "eos_token_ids", None) or ()))
        self.structured_output_manager = StructuredOutputManager(tokenizer, self.eos_token_ids)  # guided decoding
        # Ids a request may name: rows the model has AND tokens the tokenizer can decode (some models
        # pad their embedding past the tokenizer, and some detokenizers raise on those ids).
        self.vocab_size = (min(self.runner.vocab_size, len(tokenizer)) if tokenizer is not None
                           else self.runner.vocab_size)
        self._prompt_lps: dict[str, list[TokenLogprob]] = {}  # prompt logprobs, sent with the first output
        self.stats = StepStats()
        self._inflight: Optional[LaunchedStep] = None
        self.generation_defaults: dict[str, Any] = {}  # the model's recommended sampling values (from_config)
        self.async_scheduling = (self.config.async_scheduling if self.config.async_scheduling is not None
                                 else mx.default_device() == mx.gpu)
        self._warmed_up_in: Optional[int] = None  # the thread that ran warm_up
        self.drafter = make_drafter(self.config.speculative_config, self.max_model_len, self.kv_cache_manager,
                                    self.draft_proposer, self.vocab_size, (self.tokenizer, self._draft_tokenizer),
                                    weights_nbytes(self.model) if self.draft_proposer is not None else 0)
        if self.drafter is None:
            self.draft_proposer = None  # speculation is off for this target: the draft's weights go

    def warm_up(self) -> None:
        """ModelRunner.warm_up, once per thread: MLX keeps CUDA's cuDNN graphs per thread, so the
        thread that steps does it (the server's engine thread at start; otherwise the first step)."""
        if self._warmed_up_in == threading.get_ident():
            return
        self._warmed_up_in = threading.get_ident()
        if hasattr(self.runner, "warm_up"):  # a tensor-parallel driver: not there (its ranks would build their own)
            self.runner.warm_up(self.config, self.max_model_len)
        if self.drafter is not None and self.draft_proposer is not None:
            self.draft_proposer.runner.warm_up(self.config, self.max_model_len)

    def make_runner(self, verify: bool) -> ModelRunner:
        """Hook: tensor parallelism (tp/engine.py) wraps the runner."""
        draft = getattr(self.draft_proposer, "bytes_per_block", 0)
        return ModelRunner(self.model, self.config, verify, draft, self.model_identity)

    @classmethod
    def from_config(cls, config: EngineConfig, tokenizer: Any = None,
                    on_loaded: Optional[Callable[[Any], None]] = None) -> "EngineCore":
        """Load config.model (with its own tokenizer, unless one is given) and build the engine.
        on_loaded(tokenizer): called once the model is read, before the engine is built."""
        from pagedmlx.engine import kernel_prebuild
        from pagedmlx.loaders.loader import load_model, weights_path
        from pagedmlx.multimodal.loader import load_vision_encoder
        from pagedmlx.runner.check_cache import model_identity

        prebuild = kernel_prebuild.start(config)  # a first start's kernels, built while the weights are read
        model, loaded_tokenizer = load_model(config.model, dtype=config.dtype)
        tokenizer = tokenizer or loaded_tokenizer
        if on_loaded is not None:
            on_loaded(tokenizer)
        if prebuild is not None:
            prebuild.wait()
        identity = model_identity(config.model, config.dtype, weights_path(config.model))
        engine = cls(model, tokenizer, config, model_identity=identity, mm_encoder=load_vision_encoder(config.model))
        engine.load_generation_defaults(config.model)
        return engine

    def load_generation_defaults(self, model: Optional[str]) -> None:
        """Take the model's recommended sampling values (generation_config.json, or the default
        model's card) as defaults, unless config.generation_config is "vllm" (vLLM's own defaults)."""
        from pagedmlx.loaders.loader import generation_defaults

        if self.config.generation_config == "auto":
            self.generation_defaults = generation_defaults(model)

    def get_default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams from the model's defaults; `overrides` (a request's own values) win."""
        return SamplingParams(**{**self.generation_defaults, **overrides})

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        return check_token_ids(prompt_token_ids, self.vocab_size)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: Optional[SamplingParams] = None,
                    priority: int = 0, arrival_time: Optional[float] = None,
                    cache_salt: Optional[str] = None, lora_request: Optional[LoRARequest] = None,
                    mm_features: Optional[Sequence[Any]] = None) -> Request:
        """Queue a request (token ids: text is the front end's; mm_features: its images, multimodal/inputs.py).
        A bad request raises ValueError, an adapter that cannot be served too (its LoRAError says why)."""
        params = params or SamplingParams()
        if lora_request is not None:
            self.add_lora(lora_request)
        check_logit_bias(params, self.vocab_size)
        ids = self.check_prompt(prompt_token_ids)
        request = Request(request_id, ids, params, self.eos_token_ids, arrival_time=arrival_time, priority=priority,
                          cache_salt=cache_salt, lora_request=lora_request,
                          mm_features=check_mm_request(self.mm_encoder, ids, mm_features))
        self.structured_output_manager.add_request(request)  # guided decoding: compile its grammar off the step loop
        self.scheduler.add_request(request)
        if params.prompt_logprobs is not None:
            self._prompt_lps[request_id] = []
        return request

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter (ValueError saying why it cannot be served); False if loaded."""
        if self.lora_manager is None:
            raise ValueError(f"adapter {lora_request.lora_name!r}: LoRA is not enabled (enable_lora=True, "
                             f"pagedmlx serve --enable-lora)")
        return self.lora_manager.add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; requests running with it finish with it first."""
        return self.lora_manager is not None and self.lora_manager.remove_adapter(lora_id)

    def list_loras(self) -> set[int]:
        return self.lora_manager.list_adapters() if self.lora_manager is not None else set()

    def _loras_in_use(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.scheduler.requests.values() if r.lora_request is not None}

    def abort_request(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        finished = self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)
        return [self._final_output(req) for req in finished]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._inflight is not None

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    @property
    def has_step_in_flight(self) -> bool:
        """A step launched by step_with_batch_queue whose tokens are not read back yet."""
        return self._inflight is not None

    def step(self) -> list[EngineCoreOutput]:
        """Run one step and return its outputs: schedule -> build -> dispatch -> wait -> process.

        With async scheduling (by default on GPU backends) the engine overlaps instead: see
        step_with_batch_queue."""
        self.warm_up()
        if self._can_overlap():
            return self.step_with_batch_queue()
        outputs: list[EngineCoreOutput] = []
        if self._inflight is not None:  # left by an overlapped step: its tokens come first
            previous, self._inflight = self._inflight, None
            outputs += self._process(previous, self._wait(previous))
        built = self._schedule_and_build(outputs)
        if built is not None:
            self._dispatch(built)
            outputs += self._process(built, self._wait(built))
        return outputs

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Schedule and build step N+1 while step N runs on the device; return step N's outputs.

        Decodes of step N+1 take their input tokens from step N's sampled array on the device.
        Where the runner writes pages in place (the CUDA kernels), step N+1 is dispatched at once,
        so the device goes from N to N+1 without waiting for the host. Where MLX scatters into the
        pages instead, N+1 is dispatched only once step N is read back, processed and dropped:
        while anything still references step N's graph, every page write of N+1 would copy its
        layer's whole pool (MLX donates a buffer to a scatter only when nothing else references it).
        """
        outputs: list[EngineCoreOutput] = []
        built = self._schedule_and_build(outputs)
        previous, self._inflight = self._inflight, built
        self.stats.num_overlapped += previous is not None and built is not None
        in_place = self.runner.pages_in_place
        if built is not None and in_place:
            self._dispatch(built)
        if previous is not None:
            outputs += self._process(previous, self._wait(previous))
            previous.sampled = previous.arrays = previous.hidden = previous = None  # see the docstring
        if built is not None and not in_place:
            self._dispatch(built)
        return outputs

    def _schedule_and_build(self, outputs: list[EngineCoreOutput]) -> Optional[LaunchedStep]:
        """Schedule a step and build its graph; None when nothing is scheduled or building failed
        (then the step's requests are finished with an error, appended to `outputs`)."""
        for req, error in self.structured_output_manager.take_failed():  # guided decoding: grammars that failed
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
            outputs.append(self._final_output(req, error=error))
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        self.stats.schedule_s += time.perf_counter() - t0
        if so.is_empty:
            self.structured_output_manager.wait_for_grammars(0.005)  # guided decoding: only grammars compiling
            return None
        try:
            return self._build(so)
        except PagesLost as exc:  # nothing failed that a request asked for: all of them recompute
            self.scheduler.recompute_all(error_line(exc))
            return None
        except Exception as exc:  # graph building failed: only this step's requests fail
            outputs += self._fail(so, exc, [self.scheduler.requests[rid] for rid in so.req_ids])
            return None

    def _can_overlap(self) -> bool:
        """Overlap unless penalties need every earlier token on the host, or a guided request's grammar needs its
        previous token before its next mask, or requests speculate (their drafts follow the tokens the previous
        step accepted), or fewer requests run than config.async_min_batch."""
        running = self.scheduler.running
        return (self.async_scheduling and len(running) >= self.config.async_min_batch
                and not self._speculating()
                and not any(r.sampling_params.has_penalties or r.structured_output_request is not None
                            for r in running))

    def _speculating(self) -> bool:
        """Speculative decoding is configured and the batch is small enough for it (Drafter.active)."""
        return self.drafter is not None and self.drafter.active(len(self.scheduler.running))

    def _build(self, so: SchedulerOutput) -> LaunchedStep:
        """Build the step's graph (lazily: nothing runs on the device yet)."""
        t = time.perf_counter()
        requests = [self.scheduler.requests[rid] for rid in so.sampled_req_ids]
        prev_sampled = self._inflight.sampled if self._inflight is not None else None
        prev = prev_sampled.sampled_token_ids if prev_sampled is not None else None
        if so.device_drafts is not None:  # a draft model's drafts, still on the device (never with a step in flight)
            prev = so.device_drafts
        logits = self.runner.forward(so, prev)
        hidden = self.runner.last_hidden if self.keeps_hidden and self._speculating() else None
        prompt, num_rows = None, so.num_sampled_rows
        if len(so.prompt_logprob_tokens):  # the rows after the sampled ones score prompt tokens
            prompt = prompt_logprobs(logits[num_rows:], so, self.scheduler.requests)
        if requests:
            bitmask = self.structured_output_manager.grammar_bitmask(requests)  # guided rows' masks, or None
            sampled = self.sampler(logits[:num_rows] if prompt is not None else logits, requests, bitmask,
                                   so.num_draft_tokens)
            for i, req in enumerate(requests):
                req.num_output_placeholders += 1
                req.placeholder_index = i
            arrays = [a for a in (sampled.sampled_token_ids, sampled.logprobs, sampled.top_token_ids,
                                  sampled.top_logprobs) if a is not None]
        else:  # only partial prefill chunks: nothing to sample, but the pages must be written
            sampled, arrays = None, [logits]
        if prompt is not None:
            arrays += [a for a in (prompt.logprobs, prompt.top_token_ids, prompt.top_logprobs) if a is not None]
        scheduled = [self.scheduler.requests[rid] for rid in so.req_ids]
        if hidden is not None:
            arrays.append(hidden)
        return LaunchedStep(so, scheduled, sampled, arrays, time.perf_counter() - t, prompt=prompt, hidden=hidden)

    @staticmethod
    def _dispatch(step: LaunchedStep) -> None:
        """Queue the step on the device. Counted as building: MLX encodes the graph here, and may
        block here until earlier work drains."""
        t = time.perf_counter()
        try:
            mx.async_eval(*step.arrays)
        except Exception as exc:  # reported by _wait: only this step's requests fail
            step.error = exc
        step.build_s += time.perf_counter() - t

    def _wait(self, step: LaunchedStep) -> Optional[list]:
        """The step's one host sync: its sampled tokens (None if the step failed)."""
        if step.error is not None:
            return None
        t = time.perf_counter()
        try:
            rows = to_host(step.sampled) if step.sampled is not None else (mx.eval(*step.arrays) or [])
            if step.prompt is not None:
                step.prompt_rows = to_host(step.prompt)
        except Exception as exc:
            step.error = exc
            return None
        self.stats.build_s += step.build_s
        self.stats.wait_s += time.perf_counter() - t
        return rows

    def _process(self, step: LaunchedStep, rows: Optional[list]) -> list[EngineCoreOutput]:
        """Append a completed step's tokens, check stops, emit outputs."""
        so = step.so
        if rows is None:
            return self._fail(so, step.error, step.requests)
        t = time.perf_counter()
        if step.prompt_rows:
            record_prompt_logprobs(step, self.scheduler.requests, self._prompt_lps)
        token_ids = [r.token_id for r in rows]
        if so.num_draft_tokens:  # speculative decoding: each request's accepted drafts and the token after them
            so.resolve_drafts()
            token_ids, starts = verify(token_ids, so.num_draft_tokens, so.draft_token_ids)
            rows = [rows[i:i + len(kept)] for i, kept in zip(starts, token_ids)]
        else:
            rows = [[r] for r in rows]
        by_id = dict(zip(so.sampled_req_ids, rows))
        outputs = [self._output(upd.request, upd.new_token_ids, upd.finished, by_id[upd.request.request_id])
                   for upd in self.scheduler.update_from_output(so, token_ids, step.requests)]
        if self.drafter is not None:
            if step.hidden is not None and self.draft_proposer is not None:
                self.draft_proposer.observe_step(so, step.hidden, step.requests, self.drafter)
            self._propose(so, token_ids)
        self.stats.record(so, time.perf_counter() - t)
        return outputs

    def _propose(self, so: SchedulerOutput, token_ids: list) -> None:
        """Speculative decoding, after a step's update: each verified draft's acceptance feeds the
        drafter's per-request rule; then the drafts for the next step (while the batch is small)."""
        for rid, k, kept in zip(so.sampled_req_ids, so.num_draft_tokens, token_ids):
            req = self.scheduler.requests.get(rid)
            if k and req is not None:
                self.drafter.observe(req, k, len(kept) - 1)
        if self._speculating():
            try:
                drafts = self.drafter.propose_draft_token_ids(self.scheduler.running)
            except PagesLost as exc:  # the draft model's own pages (its runner zeroed them): no drafts this step
                self.draft_proposer.forget()
                logger.warning("the draft model's pages were lost (%s); it catches up from the start", error_line(exc))
                return
            self.scheduler.update_draft_token_ids(drafts)

    def _fail(self, so: SchedulerOutput, exc: Exception, requests: list[Request]) -> list[EngineCoreOutput]:
        logger.exception("step failed; finishing its %d requests with an error", so.num_reqs, exc_info=exc)
        sampled = set(so.sampled_req_ids)
        for req in requests:
            if req.request_id in sampled:
                req.num_output_placeholders = max(0, req.num_output_placeholders - 1)
        failed = self.scheduler.fail_step(so, requests)
        outputs = [self._final_output(r, error=f"{type(exc).__name__}: {exc}") for r in failed]
        if self.runner.repair_pages():  # it zeroed the pages: every running request recomputes
            self.scheduler.recompute_all(error_line(exc))
        return outputs

    def _output(self, req: Request, new_ids: list[int], finished: bool, samples: list) -> EngineCoreOutput:
        """samples: the SampledTokens of the request's rows, one per kept token (a stop may drop the last ones)."""
        rid = req.request_id
        new_lps = None
        if req.sampling_params.logprobs is not None:
            new_lps = [TokenLogprob(s.token_id, s.logprob, s.top_logprobs or []) for s in samples[:len(new_ids)]]
        return EngineCoreOutput(rid, new_ids, req.status.finish_reason if finished else None, req.stop_reason,
                                new_lps, max(req.num_cached_tokens, 0), self._prompt_lps.pop(rid, None))

    def _final_output(self, req: Request, error: Optional[str] = None) -> EngineCoreOutput:
        return EngineCoreOutput(req.request_id, [], req.status.finish_reason, req.stop_reason, None,
                                max(req.num_cached_tokens, 0), self._prompt_lps.pop(req.request_id, None), error)
