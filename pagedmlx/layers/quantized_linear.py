"""Quantized products over the step's rows as one matrix: the runner feeds its T tokens as T sequences of one
(inputs (T, 1), activations (T, 1, D)), and MLX's CUDA quantized matmul takes an input's second-to-last axis as
the product's rows and the axes before it as a batch of separate products. Over (T, 1, D) that is T products of
one row each: past a few rows its tiled kernel (qmm_sm80: tiles of at least 16 rows, one tile per batch entry)
reads the whole weight matrix once per token and computes 16 rows for each one, so a quantized model's step
costs about T times its weights' bytes (Llama-8B 4-bit at batch 64: slower than batch 1). MLX's Metal backend
folds such a batch into the rows itself; its CUDA backend does not. Reshaped to (T, D), the same product is one
matrix of T rows: the weights are read once per 64 rows, as bf16 weights' matmul does.

Inside `flat_rows()` (the runner's forward pass) the model's nn.QuantizedLinear layers (merged groups' modules
included: layers/merged_linear.py) multiply over their input's rows flattened, then give the output its shape
back: the same values, another kernel. Outside it each layer runs nn.QuantizedLinear's own call, so mlx-lm's
generation on the same model object computes exactly what it did. The LM head's rows are flattened by the runner
itself (ModelRunner.logits), which also covers a tied head (nn.QuantizedEmbedding.as_linear).
PAGEDMLX_FLAT_QUANTIZED=0 leaves the layers as they are (for comparisons: scripts/bench/bench_offline.py)."""

from __future__ import annotations

from typing import ContextManager

import mlx.core as mx
import mlx.nn as nn

from pagedmlx import envs
from pagedmlx.runner.thread_flag import ThreadFlag

_active = ThreadFlag()


def flat_rows() -> ContextManager[None]:
    """Swapped quantized layers multiply over their input's rows as one matrix (in this thread) while inside."""
    return _active.scope()


class FlatQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product, inside flat_rows(), takes every leading axis as rows."""

    def __call__(self, x: mx.array) -> mx.array:
        if _active.on and x.ndim > 2:
            return super().__call__(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        return super().__call__(x)


QUANTIZED_LINEAR = (nn.QuantizedLinear, FlatQuantizedLinear)


def flatten_quantized(model: nn.Module) -> int:
    """Swap the model's nn.QuantizedLinear layers (merged groups' separate parts included) for
    FlatQuantizedLinear; returns how many layers are swapped (those of an earlier call included)."""
    if not envs.PAGEDMLX_FLAT_QUANTIZED:
        return 0
    mods = [x for _, m in model.named_modules() for x in (m, *getattr(m, "_separate", ()))]
    swapped = 0
    for m in mods:
        if type(m) in QUANTIZED_LINEAR:
            m.__class__ = FlatQuantizedLinear
            swapped += 1
    return swapped
