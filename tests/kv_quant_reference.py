"""MLX's GPU affine quantizer (mx.quantize on CUDA and Metal: affine_quantize in their 0.32 sources) in
numpy float32, for tests on a machine without either GPU: what the quantizing page write
(kernels/page_write.py) must write there. MLX's CPU quantizer differs in two places: it rounds half to
even (rint), and a group's max starts at its first value, not at 0 (so a group of negative values only
gets a narrower scale). Elsewhere the two give the same bits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf in float32 (np.round rounds half to even; floor(x + 0.5) misrounds 0.49999997)."""
    t = np.trunc(x)
    return np.where(np.abs(x - t) >= np.float32(0.5), t + np.sign(x), t).astype(np.float32)


def gpu_quantize(x: mx.array, group_size: int, bits: int, rounding=round_half_away,
                 max_from_zero: bool = True) -> tuple[mx.array, mx.array, mx.array]:
    """mx.quantize(x, group_size, bits) as MLX's GPU backends compute it: (packed uint32 words, scales,
    biases), scales and biases in x's dtype. rounding=np.rint and max_from_zero=False: as its CPU does."""
    shape = x.shape
    g = np.array(x.astype(mx.float32)).reshape(-1, group_size)
    n_bins = np.float32(2 ** bits - 1)
    w_min = np.minimum(g.min(1), np.finfo(np.float32).max)
    w_max = np.maximum(g.max(1), np.float32(0)) if max_from_zero else g.max(1)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    side = np.abs(w_min) > np.abs(w_max)
    scale = np.where(side, scale, -scale)
    edge = np.where(side, w_min, w_max)
    q0 = rounding(edge / scale)
    at_zero = q0 == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(at_zero, scale, edge / q0).astype(np.float32)
    bias = np.where(at_zero, np.float32(0), edge).astype(np.float32)
    q = np.minimum(rounding((g - bias[:, None]) / scale[:, None]), n_bins)
    assert (q >= 0).all(), "a value below the group's bias: the GPU's conversion to uint8 is not modelled"
    per_word = 32 // bits
    q = q.astype(np.uint32).reshape(-1, per_word) << (bits * np.arange(per_word, dtype=np.uint32))
    packed = np.bitwise_or.reduce(q, axis=1).reshape(*shape[:-1], shape[-1] * bits // 32)
    parts = [mx.array(a.reshape(*shape[:-1], -1)).astype(x.dtype) for a in (scale, bias)]
    return mx.array(packed), parts[0], parts[1]
