"""SamplingParams: how one request samples and when it stops (vLLM's fields and defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from pagedmlx.structured_outputs.params import StructuredOutputsParams

MAX_SEED = 2**63 - 1


def _check_range(name: str, value: float, lo: float, hi: float, lo_open=False) -> None:
    bad = not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo)
    if bad:
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {left}{lo}, {hi}], got {value!r}")


@dataclass
class SamplingParams:
    """How one request samples and when it stops. Validated on construction:
    a bad value raises ValueError naming the field and its allowed range."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16  # None: up to max_model_len
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: Optional[int] = None  # None: none; k: the sampled token's plus the top k
    prompt_logprobs: Optional[int] = None  # as logprobs, for every prompt token after the first
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (no text, no logprob token strings, no stop strings)
    structured_outputs: Optional[StructuredOutputsParams] = None  # guided decoding (pagedmlx/structured_outputs/)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        _check_range("temperature", self.temperature, 0.0, 100.0)
        _check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None and not (0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are found in the text); use stop_token_ids "
                             f"with detokenize=False, got stop={self.stop!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must hold token ids >= 0, got {t!r}")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        # Not down to 0: below ~1e-37 dividing float32 logits by it overflows (the server's schema fuzzer
        # found 5e-324: logprobs became NaN).
        _check_range("repetition_penalty", self.repetition_penalty, 0.01, 10.0)
        for tok, bias in self.logit_bias.items():
            if tok < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tok}")
            _check_range(f"logit_bias[{tok}]", bias, -100.0, 100.0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= 20):
                raise ValueError(f"{name} must be in [0, 20], got {value!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
