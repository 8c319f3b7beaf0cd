"""What the core checks of a request before it queues it: ids that the model has and the tokenizer can decode
(EngineCore.vocab_size). Text and chat are the front end's; the core sees ids only."""

from __future__ import annotations

from typing import Sequence

from pagedmlx.sampling_params import SamplingParams


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The prompt's ids as a list; ValueError naming the first bad ones."""
    ids = list(token_ids)
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}), got {bad[:5]}")
    return ids


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """SamplingParams checks the keys are ids >= 0; their upper bound is the model's."""
    bad = [t for t in params.logit_bias if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {bad[:5]}")
