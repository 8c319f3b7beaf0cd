"""Attention masks built on the device from a step's positions and lengths (a sliding window cuts
them); the paths that gather pages into MLX's attention use them."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx


def causal_mask(key_pos: mx.array, query_pos: mx.array, window: Optional[int]) -> mx.array:
    """Which keys each query sees: up to its own position, and within the window if there is one."""
    mask = key_pos <= query_pos
    return mask if window is None else mask & (key_pos > query_pos - window)


def length_mask(seq_lens: mx.array, num_keys: int, window: Optional[int] = None) -> mx.array:
    """(B, 1, 1, num_keys): the gathered keys each decode row sees: those that exist, and under a
    sliding window its last `window` (the decode query is the last key)."""
    key_pos = mx.arange(num_keys)[None, :]
    return causal_mask(key_pos, (seq_lens - 1)[:, None], window)[:, None, None, :]
