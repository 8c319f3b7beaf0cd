"""What the engine hands back: per-sequence EngineOutputs after each step, and vLLM's
RequestOutput / CompletionOutput for the offline and async APIs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import msgspec


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []  # (token id, logprob), best first


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the engine core reports of one sequence after a step: token ids, never text (the
    OutputProcessor turns these into EngineOutputs). Crosses the process boundary as msgpack."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop", "length", "abort", "error"; None: still running
    stop_reason: Union[int, str, None] = None  # the stop token id that matched
    new_logprobs: Optional[list[TokenLogprob]] = None
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list[TokenLogprob]] = None  # complete, in the request's first output only
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineOutput:
    """One sequence's state after a step (LLMEngine.step): everything so far, plus what this step
    added (the `new_*` deltas). vLLM's engine core emits the same level of output; n > 1 requests
    appear as one sequence per sample here, and LLM / AsyncEngine.generate group them.

    Until `finished`, `token_ids` and `logprobs` are the request's own growing lists (copying them
    every step would cost O(length) per request per step): read them at once, or keep the `new_*`
    deltas. The final output's lists no longer change."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far (stop strings cut)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop", "length", "abort", "error"
    stop_reason: Any = None  # the stop token id or stop string that matched
    logprobs: Optional[list[TokenLogprob]] = None  # for every output token, when asked
    new_logprobs: Optional[list[TokenLogprob]] = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: Optional[str] = None
    # SamplingParams.prompt_logprobs: each prompt token's after the first (complete in every output)
    prompt_logprobs: Optional[list[TokenLogprob]] = None


@dataclass
class Logprob:
    """vLLM's Logprob: one candidate token's log probability and its rank (1 = most likely)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    """vLLM's CompletionOutput: one of a request's n samples."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None  # only when logprobs were asked for
    logprobs: Optional[list[dict[int, Logprob]]] = None  # per output token: the sampled one and the top k
    finish_reason: Optional[str] = None
    stop_reason: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """vLLM's RequestOutput: a prompt and its n completions (`outputs[i]`, in sample order)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: Optional[str] = None  # pagedmlx: why a request failed (finish_reason "error")
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None  # None for the first token, as vLLM
    lora_request: Any = None  # the LoRARequest it ran with, as vLLM


class RequestOutputBuilder:
    """vLLM's RequestOutput of one request, built from its samples' EngineOutputs as they arrive
    (LLM at the end, AsyncEngine.generate after every step): a sample's logprobs are converted (and
    their tokens decoded) once, as they come, not again at every step."""

    def __init__(self, request_id: str, prompt: Optional[str], num_samples: int, tokenizer: Any = None,
                 lora_request: Any = None):
        self.request_id, self.prompt, self.num_samples = request_id, prompt, num_samples
        self.lora_request = lora_request
        self.latest: dict[int, EngineOutput] = {}
        self.outputs: dict[int, CompletionOutput] = {}
        self._token_ids: dict[int, list[int]] = {}  # from the deltas: an output read late keeps its own step's
        self._logprobs: dict[int, list[dict[int, Logprob]]] = {}
        self._cumulative: dict[int, float] = {}
        self.prompt_logprobs: Optional[list] = None
        self._decoded: dict[int, Optional[str]] = {}
        self._tokenizer = tokenizer

    def add(self, index: int, out: EngineOutput) -> RequestOutput:
        """Take sample `index`'s latest output; the request's RequestOutput so far (cumulative)."""
        self.latest[index] = out
        logprobs = cumulative = None
        # Until it finishes, an output's token_ids / logprobs are the request's growing lists (EngineOutput):
        # a consumer that lags behind the engine would read later steps' tokens in them, so the deltas count.
        token_ids = self._token_ids.setdefault(index, [])
        if out.finished:
            token_ids[:] = out.token_ids
        else:
            token_ids.extend(out.new_token_ids)
        if out.logprobs is not None:
            logprobs = self._logprobs.setdefault(index, [])
            new = out.logprobs[len(logprobs):] if out.finished else out.new_logprobs or []
            logprobs.extend(self._vllm_logprobs(lp) for lp in new)
            cumulative = self._cumulative[index] = self._cumulative.get(index, 0.0) + sum(lp.logprob for lp in new)
            logprobs = list(logprobs)
        self.outputs[index] = CompletionOutput(index, out.text, list(token_ids), cumulative, logprobs,
                                               out.finish_reason, out.stop_reason)
        if self.prompt_logprobs is None and out.prompt_logprobs is not None:
            self.prompt_logprobs = [None] + [self._vllm_logprobs(lp) for lp in out.prompt_logprobs]
        first = self.latest.get(0, out)
        errors = [o.error for o in self.latest.values() if o.error]
        finished = len(self.latest) == self.num_samples and all(o.finished for o in self.latest.values())
        return RequestOutput(self.request_id, self.prompt, list(first.prompt_token_ids),
                             [self.outputs[i] for i in sorted(self.outputs)], finished, first.num_cached_tokens,
                             errors[0] if errors else None, self.prompt_logprobs, self.lora_request)

    def _decode(self, token_id: int) -> Optional[str]:
        if self._tokenizer is None:
            return None
        if token_id not in self._decoded:
            self._decoded[token_id] = self._tokenizer.decode([token_id])
        return self._decoded[token_id]

    def _vllm_logprobs(self, lp: TokenLogprob) -> dict[int, Logprob]:
        ranks = {tok: rank for rank, (tok, _) in enumerate(lp.top, 1)}
        entries = {tok: Logprob(value, rank, self._decode(tok)) for rank, (tok, value) in enumerate(lp.top, 1)}
        entries.setdefault(lp.token_id, Logprob(lp.logprob, ranks.get(lp.token_id), self._decode(lp.token_id)))
        return {lp.token_id: entries.pop(lp.token_id), **entries}  # the sampled token first, as vLLM
