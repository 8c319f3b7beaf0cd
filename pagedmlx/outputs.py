"""What the engine hands back to its callers after each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class RequestOutput:
    """A request's state after a step: everything so far, plus what this step added.

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
