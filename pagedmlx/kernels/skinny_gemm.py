"""A matmul of a few rows in one launch of our own (vLLM's skinny GEMMs), on CUDA and Metal, from one source
(sources/skinny_gemm.py, in the portable dialect).

Why: on CUDA, MLX (0.32) runs a one-row matmul as its own gemv kernel, and a matmul of 2+ rows through
cuBLASLt, building a CublasGemm, asking cublasLt's heuristic for an algorithm and capturing the call into its
graph each time. A speculative verifying step (1 + k rows) and every decode step of a few requests make ~130-190
such matmuls on Llama-8B (its verifying step spends 10.65 ms in MLX's dispatch with the device idle).
This kernel reads each weight row once for all rows, as a gemv does, and is launched as any custom kernel.
On an H100: 5.6 µs of MLX's host time a launch against cuBLASLt's 25. Where it
runs is decided at load (check_skinny_gemm against MLX's matmul).

Two kernels. The lanes' kernel (sources/skinny_gemm.py) runs by default. With PAGEDMLX_SKINNY_MMA=1, CUDA's 16-bit
weights take tensor cores instead (sources/skinny_gemm_mma_cuda.py: a thread group per 16 columns, its warps
splitting K). On an H100 it had its device time no better than the lanes' at 2-8
rows (both 0.8-1.0x cuBLASLt's), so it stays opt-in for A/Bs.

In the lanes' kernel a SIMD group computes rows_per_warp(N) columns: 4 for wide products (each row of x read from
cache once for four weight rows), fewer for narrow ones, so that a product of N = 1,024 columns (Llama-8B's k and v)
still launches ~1,000 SIMD groups to draw the GPU's bandwidth. From 4 rows, narrow products also split K across a
thread group's SIMD groups (k_split), timed on an H100 at 0.93x cuBLASLt's device time at 4 and 5 rows
against 0.88-0.90x unsplit."""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from pagedmlx import envs
from pagedmlx.kernels import build, check
from pagedmlx.kernels.dialect import CUDA, render
from pagedmlx.kernels.sources import skinny_gemm as src
from pagedmlx.kernels.sources import skinny_gemm_mma_cuda as mma_src

MIN_ROWS, MAX_ROWS = 2, 8  # x's rows a launch takes (one row: MLX's own gemv, no cuBLASLt; mma's B: 8 columns)
WARPS = 4  # SIMD groups a thread group, lanes' kernel
SPLIT_WARPS = 8192  # SIMD groups a narrow product is split up to (k_split): ~62 an SM on an H100's 132
SPLIT_MIN_ROWS = 4  # fewer rows: K unsplit (at 2 rows the split kernel was the slower, 0.88x against 1.05x)
SPLIT_FIXED = envs.PAGEDMLX_SKINNY_SPLIT  # 1, 2 or 4 for every product (A/Bs); 0: k_split
# tensor cores: warps splitting K a 16-column tile; 32-wide chunks a warp loads at once (environment: A/Bs)
MMA_WARPS = envs.PAGEDMLX_SKINNY_WARPS
MMA_UNROLL = envs.PAGEDMLX_SKINNY_UNROLL
TOLERANCE = {mx.float32: 1e-4, mx.bfloat16: 2e-2, mx.float16: 4e-3}  # relative to the output's largest magnitude
DTYPES = (mx.float32, mx.bfloat16)  # the lanes' kernel
MMA_DTYPES = (mx.bfloat16, mx.float16)


def skinny_gemm_source(backend: str, mma: bool = False) -> str:
    return render(mma_src.SKINNY_GEMM_MMA if mma else src.SKINNY_GEMM, backend)


@functools.lru_cache(maxsize=None)
def _kernel(backend: str, mma: bool = False):
    if mma:
        return build.make_kernel(backend, "pagedmlx_skinny_gemm_mma", ["x", "w"], ["y"],
                                 skinny_gemm_source(backend, True), mma_src.MMA_HEADER)
    return build.make_kernel(backend, "pagedmlx_skinny_gemm", ["x", "w"], ["y"], skinny_gemm_source(backend), "")


def _mma_on(backend: Optional[str]) -> bool:
    return backend == CUDA and envs.PAGEDMLX_SKINNY_MMA


def uses_tensor_cores(backend: Optional[str], weight: mx.array) -> bool:
    """The product runs the tensor-core kernel: CUDA with PAGEDMLX_SKINNY_MMA=1, 16-bit weights, K whole 32-value
    chunks."""
    return _tensor_cores(backend, weight.dtype, weight.shape[-1])


def _tensor_cores(backend: Optional[str], dtype: mx.Dtype, k: int) -> bool:
    return _mma_on(backend) and dtype in MMA_DTYPES and k % 32 == 0


def kernel_dtypes(backend: Optional[str]) -> set:
    """The weight dtypes some kernel takes on `backend`."""
    return set(DTYPES) | (set(MMA_DTYPES) if _mma_on(backend) else set())


def rows_per_warp(n: int) -> int:
    """y's columns a SIMD group computes for a product of n columns."""
    return 4 if n >= 8192 else 2 if n >= 4096 else 1


def k_split(n: int, k: int, dtype: mx.Dtype, rows: int) -> int:
    """SIMD groups of a thread group sharing its columns, each every SPLIT-th step of K (1, 2 or WARPS): from
    SPLIT_MIN_ROWS rows, a narrow product gets at least SPLIT_WARPS SIMD groups in all, as long as each still takes 4
    steps of K. Llama-8B's o and down products (4,096 columns) launch only 2,048 SIMD groups unsplit (15 an SM).
    On an H100 (32 layers' products against cuBLASLt's device time): unsplit 1.05x / 0.90x /
    0.88x at 2 / 4 / 5 rows, split so 0.88x / 0.93x / 0.93x. PAGEDMLX_SKINNY_SPLIT fixes it (A/Bs)."""
    if SPLIT_FIXED:
        return SPLIT_FIXED
    if rows < SPLIT_MIN_ROWS:
        return 1
    warps, steps, split = -(-n // rows_per_warp(n)), k // (32 * 16 // dtype.size), 1
    while split < WARPS and warps * split < SPLIT_WARPS and steps >= 4 * split * 2:
        split *= 2
    return split


def supports(rows: int, weight: mx.array, backend: Optional[str] = None) -> bool:
    """A kernel takes x of `rows` rows against this (N, K) weight on `backend`: 2-8 rows; tensor cores
    (uses_tensor_cores), or the lanes' kernel for float32 or bfloat16 with K a whole number of a lane's 16-byte
    loads (a last step of K that not every lane takes is guarded)."""
    if not (MIN_ROWS <= rows <= MAX_ROWS and weight.ndim == 2):
        return False
    return uses_tensor_cores(backend, weight) or (weight.dtype in DTYPES
                                                  and weight.shape[1] % (16 // weight.dtype.size) == 0)


def skinny_gemm(x: mx.array, w: mx.array, backend: Optional[str] = None, *, mma: Optional[bool] = None,
                warps: int = MMA_WARPS, unroll: int = MMA_UNROLL, split: Optional[int] = None) -> mx.array:
    """x @ w.T for x (..., K) of MIN_ROWS to MAX_ROWS rows in all and w (N, K), as MLX's matmul computes it up to the
    order of its float sums (supports() says which shapes). mma: the tensor-core kernel (default: where
    uses_tensor_cores); warps, unroll: its launch; split: the lanes' kernel's split of K (default k_split; studies)."""
    backend = backend or build.gpu_backend()
    *lead, k = x.shape
    rows, n = x.size // k, w.shape[0]
    mma, template, groups, threads = _launch(backend, n, k, w.dtype, rows, mma, warps, unroll, split)
    y = _kernel(backend, mma)(
        inputs=[x.reshape(rows, k).astype(w.dtype), w], template=template, grid=(groups * threads, 1, 1),
        threadgroup=(threads, 1, 1), output_shapes=[(rows, n)], output_dtypes=[w.dtype])[0]
    return y.reshape(*lead, n)


def _launch(backend: Optional[str], n: int, k: int, dtype: mx.Dtype, rows: int, mma: Optional[bool] = None,
            warps: int = MMA_WARPS, unroll: int = MMA_UNROLL,
            split: Optional[int] = None) -> tuple[bool, list, int, int]:
    """(the tensor-core kernel or the lanes', its template, thread groups, threads a group) for a product of
    rows x K @ (N x K)^T."""
    if _tensor_cores(backend, dtype, k) if mma is None else mma:
        return (True, [("T", dtype), ("M", rows), ("K", k), ("WARPS", warps), ("UNROLL", unroll)], -(-n // 16),
                32 * warps)
    per_warp, split = rows_per_warp(n), split or k_split(n, k, dtype, rows)
    return (False, [("T", dtype), ("M", rows), ("K", k), ("ROWS", per_warp), ("WARPS", WARPS), ("SPLIT", split)],
            -(-n // (per_warp * WARPS // split)), 32 * WARPS)


def prebuild(backend: str, shapes: Sequence[tuple[int, int]], dtype: mx.Dtype, rows: Sequence[int]) -> None:
    """Compile the variants of these (N, K) shapes and row counts into the disk cache before their first launches
    (kernels/disk_cache.py), where the cache is on."""
    by_kernel: dict = {}
    for n, k in shapes:
        for r in rows:
            mma, template, _, _ = _launch(backend, n, k, dtype, r)
            by_kernel.setdefault(mma, []).append(([(dtype, 2), (dtype, 2)], [dtype], template))
    for mma, variants in by_kernel.items():
        kernel = _kernel(backend, mma)
        if hasattr(kernel, "prebuild"):
            kernel.prebuild(variants)


def check_skinny_gemm(backend: str, shapes: tuple[tuple[int, int], ...], dtype: mx.Dtype = mx.bfloat16,
                      rows_checked: Sequence[int] = range(MIN_ROWS, MAX_ROWS + 1), seed: int = 0) -> Optional[str]:
    """The kernel against MLX's matmul on the device for each (N, K) in `shapes` (the model's, at load) and each
    row count (N that no thread group's columns divide included). None if every output agrees within the dtype's
    tolerance, else what differs."""
    try:
        return _check(backend, shapes, dtype, rows_checked, seed)
    except Exception as exc:  # compilation or launch: MLX raises when the kernel is built or run
        return f"did not compile or run ({check.error_line(exc)})"


def _check(backend: str, shapes: tuple[tuple[int, int], ...], dtype: mx.Dtype, rows_checked: Sequence[int],
           seed: int) -> Optional[str]:
    prebuild(backend, shapes, dtype, rows_checked)
    # drawn on the device: numpy took ~27 s (this CPU) for Llama-8B's widths, its 128k-row head most of it
    keys = iter(mx.random.split(mx.random.key(seed), len(shapes) * (1 + len(rows_checked))))
    for n, k in shapes:
        w = mx.random.normal((n, k), dtype, scale=k ** -0.5, key=next(keys))
        for rows in rows_checked:
            x = mx.random.normal((rows, k), dtype, key=next(keys))
            got, want = skinny_gemm(x, w, backend).astype(mx.float32), (x @ w.T).astype(mx.float32)
            err = (mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-6)).item()
            if not (np.isfinite(err) and err <= TOLERANCE[dtype]):
                return (f"max relative difference {err:.2e} > {TOLERANCE[dtype]:.0e} ({rows} rows x {k} @ {n} x {k}, "
                        f"{check._dtype_name(dtype)})")
    return None
