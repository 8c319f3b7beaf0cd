"""What the engine hands back: per-sequence EngineOutputs after each step, and vLLM's
RequestOutput / CompletionOutput for the offline and async APIs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


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


def completion_output(out: EngineOutput, index: int = 0, tokenizer: Any = None) -> CompletionOutput:
    """One sample's CompletionOutput from the engine's output for it."""
    logprobs = cumulative = None
    if out.logprobs is not None:
        logprobs = [_vllm_logprobs(lp, tokenizer) for lp in out.logprobs]
        cumulative = sum(lp.logprob for lp in out.logprobs)
    return CompletionOutput(index, out.text, list(out.token_ids), cumulative, logprobs,
                            out.finish_reason, out.stop_reason)


def prompt_logprobs(lps: Optional[list[TokenLogprob]], tokenizer: Any = None) -> Optional[list]:
    """vLLM's RequestOutput.prompt_logprobs: None for the first prompt token, then a dict per token."""
    return None if lps is None else [None] + [_vllm_logprobs(lp, tokenizer) for lp in lps]


def _vllm_logprobs(lp: TokenLogprob, tokenizer: Any) -> dict[int, Logprob]:
    def decode(t: int) -> Optional[str]:
        return tokenizer.decode([t]) if tokenizer is not None else None

    ranks = {tok: rank for rank, (tok, _) in enumerate(lp.top, 1)}
    entries = {tok: Logprob(value, rank, decode(tok)) for rank, (tok, value) in enumerate(lp.top, 1)}
    entries.setdefault(lp.token_id, Logprob(lp.logprob, ranks.get(lp.token_id), decode(lp.token_id)))
    return {lp.token_id: entries.pop(lp.token_id), **entries}  # the sampled token first, as vLLM
