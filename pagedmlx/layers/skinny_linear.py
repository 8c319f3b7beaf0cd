"""The few-row products of plain linear layers (x @ W^T over 2-8 rows: a speculative verifying step's, a small
batch's decode) as kernels/skinny_gemm.py's one launch, inside the runner's forward pass
(EngineConfig.skinny_gemm). Outside it each layer runs nn.Linear's own call, so mlx-lm's generation on the same
model object, the load-time check's reference included, computes what it did before."""

from __future__ import annotations

import logging
from typing import ContextManager, Iterable, Optional

import mlx.core as mx
import mlx.nn as nn

from pagedmlx import envs
from pagedmlx.kernels import build, skinny_gemm
from pagedmlx.kernels.dialect import CUDA
from pagedmlx.runner.thread_flag import ThreadFlag

logger = logging.getLogger("pagedmlx")

_active = ThreadFlag()
# The most rows the engine gives the kernel: its device time trails cuBLASLt's most at 8 rows (on an
# H100), while 2-5 rows (a verifying step of k 4, decodes of a few requests) gain its lower host cost.
MAX_ROWS = envs.PAGEDMLX_SKINNY_MAX_ROWS


def skinny_products() -> ContextManager[None]:
    """Swapped linear layers take the kernel for few-row inputs (in this thread) while inside."""
    return _active.scope()


def rows_taken() -> range:
    """The row counts the engine gives the kernel (each its own build: the load-time check takes only these)."""
    return range(skinny_gemm.MIN_ROWS, min(MAX_ROWS, skinny_gemm.MAX_ROWS) + 1)


class SkinnyLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if _active.on and rows <= MAX_ROWS and skinny_gemm.supports(rows, self.weight, self._pagedmlx_backend):
            y = skinny_gemm.skinny_gemm(x, self.weight, self._pagedmlx_backend)
            return y + self["bias"] if "bias" in self else y
        return super().__call__(x)


def _linears(model: nn.Module) -> list[nn.Linear]:
    """The model's plain linear layers, merged groups' separate parts included (layers/merged_linear.py: a
    verifying step's q/k/v run as parts)."""
    mods = [x for _, m in model.named_modules() for x in (m, *getattr(m, "_separate", ()))]
    return [m for m in mods if type(m) in (nn.Linear, SkinnyLinear)]


def checked_shapes(products: Iterable[tuple[int, int]], dtype: mx.Dtype) -> tuple[tuple[int, int], ...]:
    """The (N, K) products the load-time check runs: one per kernel the model's products build (width K, columns a
    SIMD group, split of K at each row count taken), the smallest N of each."""
    shapes = {}
    for n, k in products:
        splits = tuple(skinny_gemm.k_split(n, k, dtype, rows) for rows in rows_taken())
        key = (k, skinny_gemm.rows_per_warp(n), splits)
        shapes[key] = min(n, shapes.get(key, n))
    return tuple((n, k) for (k, *_), n in sorted(shapes.items()))


def use_skinny_gemm(setting: Optional[bool], model: nn.Module, kernels_enabled: bool) -> bool:
    """EngineConfig.skinny_gemm at load (None: on CUDA): swap the model's plain linear layers where the kernel runs
    (a GPU backend whose kernels are on), those of widths it takes, if it passes its check at their widths and
    dtype. Warns why not, except by default for a model it cannot take (quantized layers, other dtypes or widths),
    which keeps MLX's matmul quietly."""
    backend = build.gpu_backend()
    if not (setting or (setting is None and backend == CUDA and kernels_enabled)):
        return False
    linears = _linears(model)
    dtypes = {m.weight.dtype for m in linears}
    takes = skinny_gemm.kernel_dtypes(backend)
    taken = [m for m in linears if skinny_gemm.supports(skinny_gemm.MIN_ROWS, m.weight, backend)]  # widths it takes
    why = ("it needs a GPU backend's kernels" if backend is None or not kernels_enabled
           else f"weights in {sorted(map(str, dtypes))}: the kernels take {sorted(map(str, takes))}"
           if len(dtypes) > 1 or not dtypes <= takes
           else "the model has no plain linear layers of a width the kernel takes" if not taken else None)
    if why is not None and setting is None:  # by default a model it cannot take keeps MLX's matmul quietly
        logger.info("few-row products left to MLX's matmul (skinny_gemm): %s", why)
        return False
    if why is None:
        dtype = dtypes.pop()
        why = skinny_gemm.check_skinny_gemm(backend, checked_shapes([m.weight.shape for m in taken], dtype), dtype,
                                            rows_checked=rows_taken())
    if why is not None:
        logger.warning("few-row products left to MLX's matmul (skinny_gemm): %s", why)
        return False
    for m in taken:
        m.__class__, m._pagedmlx_backend = SkinnyLinear, backend
    logger.info("%d of %d linear layers take the skinny GEMM kernel for %d-%d rows (layers/skinny_linear.py)",
                len(taken), len(linears), rows_taken()[0], rows_taken()[-1])
    return True


def drop_skinny_gemm(model: nn.Module) -> bool:
    """Every swapped layer back to nn.Linear's own call; False (the runner's flag)."""
    for m in _linears(model):
        m.__class__ = nn.Linear
    return False

