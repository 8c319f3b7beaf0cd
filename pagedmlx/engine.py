"""LLMEngine: the step loop (schedule -> forward -> sample -> update -> outputs), and LLM, the
offline API on top of it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from pagedmlx.config import EngineConfig
from pagedmlx.detokenizer import IncrementalDetokenizer
from pagedmlx.kv.manager import KVCacheManager
from pagedmlx.outputs import RequestOutput, TokenLogprob
from pagedmlx.request import Request, RequestStatus, SamplingParams
from pagedmlx.runner.model import ModelRunner
from pagedmlx.sampler import Sampler, to_host
from pagedmlx.scheduler import Scheduler

logger = logging.getLogger("pagedmlx")

PromptType = Union[str, Sequence[int]]
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class StepStats:
    """Where a step's time goes: host work around the forward pass versus the pass itself."""

    num_steps: int = 0
    schedule_s: float = 0.0
    forward_s: float = 0.0  # graph building, device work and the one host sync
    update_s: float = 0.0  # appending tokens, stop checks, detokenization
    num_tokens: int = 0
    num_sampled: int = 0
    recent: list = field(default_factory=list)

    def host_fraction(self) -> float:
        total = self.schedule_s + self.forward_s + self.update_s
        return (self.schedule_s + self.update_s) / total if total else 0.0


class LLMEngine:
    def __init__(self, model: nn.Module, tokenizer: Any, config: Optional[EngineConfig] = None,
                 verify_model: bool = True):
        self.config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.runner = self.make_runner(verify_model)
        self.max_model_len = self._max_model_len()
        self.kv_cache_manager = KVCacheManager(self.runner.num_blocks, self.config.block_size,
                                               self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.kv_cache_manager, self.max_model_len)
        self.sampler = Sampler()
        self.eos_token_ids = tuple(sorted(getattr(tokenizer, "eos_token_ids", None) or ()))
        self.vocab_size = self.runner.vocab_size
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._logprobs: dict[str, list[TokenLogprob]] = {}
        self.stats = StepStats()

    def make_runner(self, verify: bool) -> ModelRunner:
        """Hook: tensor parallelism (pagedmlx.distributed.TPEngine) wraps the runner."""
        return ModelRunner(self.model, self.config.block_size, self.config.num_blocks,
                           self.config.kv_cache_memory_gb, verify=verify)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        from pagedmlx.loader import load_model

        model, tokenizer = load_model(config.model)
        return cls(model, tokenizer, config)

    def _max_model_len(self) -> int:
        args = getattr(self.model, "args", None)
        limit = self.config.max_model_len or getattr(args, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
        capacity = self.runner.num_blocks * self.config.block_size
        if limit > capacity:
            logger.warning("max_model_len %d exceeds the KV pool (%d tokens); capping it", limit, capacity)
        return min(limit, capacity)

    # ---- requests ---------------------------------------------------------------------------

    def encode(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give prompts as token ids")
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}")
        return ids

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    priority: int = 0, arrival_time: Optional[float] = None,
                    cache_salt: Optional[str] = None) -> Request:
        params = params or SamplingParams()
        bad_bias = [t for t in params.logit_bias if t >= self.vocab_size]
        if bad_bias:
            raise ValueError(f"logit_bias keys must be token ids in [0, {self.vocab_size}), got {bad_bias[:5]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        request = Request(request_id, self.encode(prompt), params, self.eos_token_ids,
                          arrival_time=arrival_time, priority=priority, cache_salt=cache_salt)
        self.scheduler.add_request(request)
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params)
        if params.logprobs is not None:
            self._logprobs[request_id] = []
        return request

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        finished = self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)
        return [self._final_output(req) for req in finished]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        t1 = time.perf_counter()
        if so.is_empty:
            return []
        requests = [self.scheduler.requests[rid] for rid in so.sampled_req_ids]
        try:
            sampled = []
            if requests:
                logits = self.runner.forward(so)
                sampled = to_host(self.sampler(logits, requests))
            else:  # only partial prefill chunks: nothing to sample, but the pages must be written
                mx.eval(self.runner.forward(so))
        except Exception as exc:  # one failed step fails only its own requests
            logger.exception("step failed; finishing its %d requests with an error", so.num_reqs)
            return [self._final_output(r, error=f"{type(exc).__name__}: {exc}") for r in self.scheduler.fail_step(so)]
        t2 = time.perf_counter()
        by_id = dict(zip(so.sampled_req_ids, sampled))
        outputs = []
        for upd in self.scheduler.update_from_output(so, [s.token_id for s in sampled]):
            outputs.append(self._make_output(upd.request, upd.new_token_ids, upd.finished, by_id[upd.request.request_id]))
        t3 = time.perf_counter()
        self._record(so, t1 - t0, t2 - t1, t3 - t2)
        return outputs

    def _record(self, so, schedule_s: float, forward_s: float, update_s: float) -> None:
        s = self.stats
        s.num_steps += 1
        s.schedule_s += schedule_s
        s.forward_s += forward_s
        s.update_s += update_s
        s.num_tokens += so.total_num_scheduled_tokens
        s.num_sampled += len(so.sampled_req_ids)

    def _make_output(self, req: Request, new_ids: list[int], finished: bool, sample: Any) -> RequestOutput:
        rid = req.request_id
        detok = self._detokenizers[rid]
        new_text, stop = detok.update(new_ids, finished)
        if stop is not None:  # a stop string ends the request, whatever else ended it this step
            if not finished:
                self.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
                finished = True
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = stop
        new_lps = None
        if rid in self._logprobs:
            new_lps = [TokenLogprob(sample.token_id, sample.logprob, sample.top_logprobs or [])]
            self._logprobs[rid].extend(new_lps)
        out = RequestOutput(rid, req.prompt_token_ids, req.output_token_ids, detok.text, new_ids, new_text,
                            finished, req.status.finish_reason if finished else None, req.stop_reason,
                            self._logprobs.get(rid), new_lps, max(req.num_cached_tokens, 0))
        if finished:
            self._forget(rid)
        return out

    def _final_output(self, req: Request, error: Optional[str] = None) -> RequestOutput:
        detok = self._detokenizers.get(req.request_id)
        text = detok.text if detok else ""
        out = RequestOutput(req.request_id, req.prompt_token_ids, req.output_token_ids, text, [], "", True,
                            req.status.finish_reason, req.stop_reason, self._logprobs.get(req.request_id),
                            None, max(req.num_cached_tokens, 0), error)
        self._forget(req.request_id)
        return out

    def _forget(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self._logprobs.pop(request_id, None)


class LLM:
    """Offline generation: `LLM(model).generate(prompts, params)` runs them all through one engine,
    sharing every forward pass, and returns one RequestOutput per prompt (per sample when n > 1),
    in prompt order."""

    def __init__(self, model: Union[str, nn.Module, None] = None, tokenizer: Any = None, **config: Any):
        if isinstance(model, nn.Module):
            self.engine = LLMEngine(model, tokenizer, EngineConfig(**config))
        else:
            self.engine = LLMEngine.from_config(EngineConfig(model=model, **config))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: Optional[bool] = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, params):
            p = p or SamplingParams()
            for i in range(p.n):
                rid = f"{self._counter}-{i}" if p.n > 1 else str(self._counter)
                self.engine.add_request(rid, prompt, child_params(p, i))
                ids.append(rid)
            self._counter += 1
        show = use_tqdm if use_tqdm is not None else len(ids) >= 8
        return self._run(ids, show)

    def chat(self, messages: list[dict], sampling_params: Optional[SamplingParams] = None,
             use_tqdm: Optional[bool] = None) -> list[RequestOutput]:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([prompt], sampling_params, use_tqdm)

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        from rich.progress import Progress

        done: dict[str, RequestOutput] = {}
        with Progress(disable=not show_progress, transient=True) as progress:
            task = progress.add_task("generating", total=len(ids))
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        progress.advance(task)
        return [done[i] for i in ids]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: its own seed (seed + i) when seeded, so that the n samples differ."""
    from dataclasses import replace

    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)
