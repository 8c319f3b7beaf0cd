"""The model's body and LM head, apart: only sampled rows need the vocabulary projection (Gemma's
262k-token head on every prefill row would cost more than the layers). The runner's load-time check
(runner/selfcheck.py) verifies the split; a model whose split disagrees runs whole."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn


def split_lm_head(model: nn.Module) -> tuple[Optional[Callable], Optional[Callable]]:
    """(body, head) of an mlx-lm model, or (None, None). A multimodal wrapper's text model is split
    (Gemma 3 / 4 and Qwen3.5 checkpoints load wrapped); a model without an lm_head is taken as tied
    to its embedding (a wrong guess fails the check); final logit soft-capping joins the head."""
    m = model
    text = getattr(m, "language_model", None)
    if isinstance(text, nn.Module):
        m = text
    body = getattr(m, "model", None)
    if not callable(body):
        return None, None
    head = getattr(m, "lm_head", None)
    if head is None and hasattr(body, "embed_tokens"):
        head = body.embed_tokens.as_linear
    if head is None:
        return None, None
    cap = getattr(m, "final_logit_softcapping", None)
    return body, (head if not cap else _soft_capped(head, cap))


def _soft_capped(head: Callable, cap: float) -> Callable:
    """The LM head followed by final logit soft-capping, as Gemma 2 / 3n / 4 apply it."""
    def capped(h: mx.array) -> mx.array:
        return mx.tanh(head(h) / cap) * cap
    return capped
