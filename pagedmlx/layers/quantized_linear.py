"""Quantized products over the step's rows as one matrix, and on CUDA as our own kernel.

The runner feeds its T tokens as T sequences of one (inputs (T, 1), activations (T, 1, D)), and MLX's CUDA
quantized matmul takes an input's second-to-last axis as the product's rows and the axes before it as a batch of
separate products. Over (T, 1, D) that is T products of one row each: past a few rows its tiled kernel (qmm_sm80:
tiles of at least 16 rows, one tile per batch entry) reads the whole weight matrix once per token (Llama-8B 4-bit
at batch 64: slower than batch 1). MLX's Metal backend folds such a batch into the rows itself; its CUDA backend
does not. Reshaped to (T, D), the same product is one matrix of T rows.

Inside `flat_rows()` (the runner's forward pass) the model's nn.QuantizedLinear layers (merged groups' modules
included: layers/merged_linear.py) multiply over their input's rows flattened, then give the output its shape
back: the same values, another kernel. Where use_quantized_gemm() swapped them in (CUDA, affine 4- and 8-bit
weights, its load-time check passed), products of QUANTIZED_GEMM_ROWS rows run kernels/quantized_gemm.py instead.
Outside flat_rows() each layer runs nn.QuantizedLinear's own call, so mlx-lm's generation on the same model object
computes exactly what it did. The LM head's rows are flattened by the runner itself (ModelRunner.logits), which
also covers a tied head (nn.QuantizedEmbedding.as_linear). PAGEDMLX_FLAT_QUANTIZED=0 leaves the layers as they are
(for comparisons: scripts/bench/bench_offline.py)."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from pagedmlx import envs
from pagedmlx.kernels import build, quantized_gemm
from pagedmlx.kernels.dialect import CUDA
from pagedmlx.runner import check_cache
from pagedmlx.runner.thread_flag import ThreadFlag

logger = logging.getLogger("pagedmlx")

_active = ThreadFlag()
_mlx_products = ThreadFlag()  # inside flat_rows(kernels=False): MLX's own products over the flattened rows
# The row counts the engine gives the kernel (PAGEDMLX_QUANTIZED_GEMM_MIN_ROWS=2 leaves one-row products to MLX's
# matrix-vector kernel).
QUANTIZED_GEMM_ROWS = range(envs.PAGEDMLX_QUANTIZED_GEMM_MIN_ROWS, quantized_gemm.MAX_ROWS + 1)


@contextlib.contextmanager
def flat_rows(kernels: bool = True) -> Iterator[None]:
    """Swapped quantized layers multiply over their input's rows as one matrix (in this thread) while inside: through
    our kernels where they are on, or with kernels=False MLX's own products (the load-time check's reference, which
    must not take the kernels it judges)."""
    with _active.scope(), (contextlib.nullcontext() if kernels else _mlx_products.scope()):
        yield


def kernels_on() -> bool:
    """This thread's swapped layers may run our kernels (inside flat_rows(), kernels not turned away)."""
    return _active.on and not _mlx_products.on


class FlatQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product, inside flat_rows(), takes every leading axis as rows, through the
    quantized GEMM kernel where use_quantized_gemm() turned it on (_kernel)."""

    _kernel = False

    def __call__(self, x: mx.array) -> mx.array:
        if not _active.on:
            return super().__call__(x)
        if self._kernel and not _mlx_products.on and x.size // x.shape[-1] in QUANTIZED_GEMM_ROWS:
            y = quantized_gemm.quantized_gemm(x, self.weight, self.scales, self.biases, self.bits, self.group_size)
            return y + self["bias"] if "bias" in self else y
        if x.ndim > 2:
            return super().__call__(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        return super().__call__(x)


QUANTIZED_LINEAR = (nn.QuantizedLinear, FlatQuantizedLinear)


def _quantized_linears(model: nn.Module) -> list[nn.QuantizedLinear]:
    """The model's nn.QuantizedLinear layers, merged groups' separate parts included."""
    mods = [x for _, m in model.named_modules() for x in (m, *getattr(m, "_separate", ()))]
    return [m for m in mods if type(m) in QUANTIZED_LINEAR]


def flatten_quantized(model: nn.Module) -> int:
    """Swap the model's nn.QuantizedLinear layers (merged groups' separate parts included) for
    FlatQuantizedLinear; returns how many layers are swapped (those of an earlier call included)."""
    if not envs.PAGEDMLX_FLAT_QUANTIZED:
        return 0
    mods = _quantized_linears(model)
    for m in mods:
        m.__class__ = FlatQuantizedLinear
    return len(mods)


def _takes(m: nn.QuantizedLinear) -> bool:
    k = m.weight.shape[1] * 32 // m.bits
    return (type(m) is FlatQuantizedLinear and "biases" in m
            and quantized_gemm.supports(QUANTIZED_GEMM_ROWS[-1], k, m.scales.dtype, m.bits, m.group_size,
                                        getattr(m, "mode", "affine")))


def wanted(setting: Optional[bool], kernels_enabled: bool) -> bool:
    """EngineConfig.quantized_gemm asks for our quantized kernels (None: on CUDA with the paged kernels on)."""
    return bool(setting or (setting is None and build.gpu_backend() == CUDA and kernels_enabled))


def use_quantized_gemm(setting: Optional[bool], model: nn.Module, kernels_enabled: bool) -> bool:
    """EngineConfig.quantized_gemm at load (None: on CUDA): the model's flattened quantized layers of a format the
    kernel takes run it for QUANTIZED_GEMM_ROWS rows, if it passes its check at their widths. Warns why not when
    asked for; by default a model with no such layers keeps MLX's quantized matmul quietly."""
    backend = build.gpu_backend()
    if not wanted(setting, kernels_enabled):
        return False
    taken = [m for m in _quantized_linears(model) if _takes(m)]
    why = ("it needs CUDA's kernels" if backend != CUDA or not kernels_enabled
           else "no quantized layer of a format it takes (affine 4 or 8 bits, group size 32, 64 or 128, "
                "16-bit scales)" if not taken else None)
    if why is not None and setting is None:
        return False
    if why is None:
        by_dtype: dict = {}  # a shape checked for each format, K and set of launches the engine's rows meet
        for m in taken:
            shape = (m.weight.shape[0], m.weight.shape[1] * 32 // m.bits, m.bits, m.group_size)
            launches = tuple(quantized_gemm.launch_for(*shape[:2], r, *shape[2:]) for r in quantized_gemm.check_rows(
                QUANTIZED_GEMM_ROWS[-1]))
            by_dtype.setdefault(m.scales.dtype, {})[(shape[1:], launches)] = shape
        for dtype, shapes in by_dtype.items():  # each skipped where it passed before (runner/check_cache.py)
            checked = sorted(shapes.values())
            run = functools.partial(quantized_gemm.check_quantized_gemm, checked, dtype)
            if (why := check_cache.kept("quantized_gemm", run, checked, dtype)) is not None:
                break
    if why is not None:
        logger.warning("quantized products left to MLX's quantized matmul (quantized_gemm): %s", why)
        return False
    for m in taken:
        m._kernel = True
    logger.info("%d quantized layers take the quantized GEMM kernel for %d-%d rows (layers/quantized_linear.py)",
                len(taken), QUANTIZED_GEMM_ROWS[0], QUANTIZED_GEMM_ROWS[-1])
    return True


def drop_quantized_gemm(model: nn.Module) -> bool:
    """Every layer back to MLX's quantized matmul; False (the runner's flag)."""
    for m in _quantized_linears(model):
        m._kernel = False
    return False
