"""The residual add and the RMSNorm after it in one launch (vLLM's fused_add_rms_norm), on CUDA and Metal,
from one source (sources/add_rms_norm.py, in the portable dialect).

A pre-norm decoder layer adds each sublayer's output to the residual stream and normalizes the sum for the
next sublayer: two launches a norm, four a layer (layers/fused_residual.py). At batch 1 a GPU step is
bound by MLX's dispatch of its launches, ~9 us each on the H200, so this
takes about 2 of a Llama layer's ~13 away. Where it runs is decided at load (check_add_rms_norm against
MLX's add and mx.fast.rms_norm)."""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx
import numpy as np

from pagedmlx.kernels import build, check
from pagedmlx.kernels.dialect import render
from pagedmlx.kernels.sources import add_rms_norm as src

THREADS = 256  # a group's (sources/add_rms_norm.py)
# Tighter than kernels/check.py's: the output is one rounding of a normalized value (the check must catch a
# mean over one channel too few at width 576, a relative error of ~1e-3).
TOLERANCE = {mx.float32: 1e-5, mx.float16: 1e-2, mx.bfloat16: 2e-2}


def add_rms_norm_source(backend: str) -> str:
    return render(src.ADD_RMS_NORM, backend)


@functools.lru_cache(maxsize=None)
def _kernel(backend: str):
    return build.make_kernel(backend, "pagedmlx_add_rms_norm", ["x", "r", "w", "eps"], ["h", "y"],
                             add_rms_norm_source(backend), "")


def add_rms_norm(x: mx.array, r: mx.array, weight: mx.array, eps: float,
                 backend: Optional[str] = None) -> tuple[mx.array, mx.array]:
    """(h, y): h = x + r and y = mx.fast.rms_norm(h, weight, eps), in one launch. x and r of one shape
    (..., D) and dtype, weight (D,)."""
    shape, d = x.shape, x.shape[-1]
    rows = x.size // d
    h, y = _kernel(backend or build.gpu_backend())(
        inputs=[x.reshape(rows, d), r.reshape(rows, d), weight, build.device_constant(eps, mx.float32)],
        template=[("T", x.dtype), ("D", d)], grid=(rows * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, d), (rows, d)], output_dtypes=[x.dtype, x.dtype])
    return h.reshape(shape), y.reshape(shape)


def check_add_rms_norm(backend: str, dtype: mx.Dtype = mx.bfloat16, dims: tuple[int, ...] = (576, 4096),
                       seed: int = 0) -> Optional[str]:
    """The kernel against MLX's own add and mx.fast.rms_norm on the device, on random rows of each width in
    `dims` (the model's, at load; widths that are no multiple of the group's 256 threads included). None
    if h is equal and y agrees within the dtype's tolerance, else what differs."""
    rng = np.random.default_rng(seed)
    for d in dims:
        x, r = (mx.array(rng.standard_normal((5, d)).astype(np.float32) * s).astype(dtype) for s in (1.0, 3.0))
        w = mx.array(rng.uniform(0.5, 1.5, d).astype(np.float32)).astype(dtype)
        h, y = add_rms_norm(x, r, w, 1e-5, backend)
        want_h = x + r
        want_y = mx.fast.rms_norm(want_h, w, 1e-5)
        if not mx.array_equal(h, want_h).item():
            return f"the sum differs from MLX's add (width {d}, {check._dtype_name(dtype)})"
        err = (mx.abs(y.astype(mx.float32) - want_y.astype(mx.float32)).max()
               / mx.abs(want_y.astype(mx.float32)).max()).item()
        if not (np.isfinite(err) and err <= TOLERANCE[dtype]):
            return f"max relative difference {err:.2e} > {TOLERANCE[dtype]:.0e} (width {d}, {check._dtype_name(dtype)})"
    return None
