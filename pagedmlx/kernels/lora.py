"""Batched LoRA in one kernel a layer (vLLM's punica bgmv shrink + expand), on CUDA and Metal, from one
source (sources/lora.py, in the portable dialect): each row adds its own adapter's scaled low-rank
product to the base layer's output, slot 0 adding nothing.

MLX's own ops need four launches a layer for the same (lora/layers.py: the stacked products, the
column mask, the scaled add); on the H200 those took 58 us a Llama-8B projection at 64 rows against
26 us for the projection itself (scripts/bench/study_lora_ops.py, run 42), because each tiny product
is launch-bound. Where it runs is decided at load (check_add_lora against the stacked path)."""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx
import numpy as np

from pagedmlx.kernels import build
from pagedmlx.kernels.dialect import render
from pagedmlx.kernels.sources import lora as src

THREADS = 256  # a group's (sources/lora.py)
GROUPS = 128  # groups a launch aims at (about one a streaming multiprocessor of an H100 / H200)
# Rows a launch takes: each row reads its adapter's A and B (R * (IN + OUT) values, from L2) once per
# tile, so the kernel's traffic grows with the rows while the stacked products' (lora/layers.py: two
# small GEMMs, a mask and a scaled add) barely do. Decode steps fit; long prefill steps take MLX's products.
MAX_ROWS = 512


def tiles_for(rows: int, out_dims: int) -> int:
    """Groups a row (tiles of its output columns). Each recomputes the row's shrink, R * IN reads of A
    from L2, so a row takes as few as keep ~GROUPS groups busy: 2 at 64 rows, 1 from 128, OUT / 256 at 1."""
    return max(1, min(-(-out_dims // THREADS), -(-GROUPS // rows)))


def add_lora_source(backend: str) -> str:
    return render(src.ADD_LORA, backend)


@functools.lru_cache(maxsize=None)
def _kernel(backend: str):
    return build.make_kernel(backend, "pagedmlx_add_lora", ["x", "y", "lora_a", "lora_b", "indices", "scales"],
                             ["out"], add_lora_source(backend), render(src.HEADER, backend))


def add_lora(x: mx.array, y: mx.array, lora_a: mx.array, lora_b: mx.array, indices: mx.array, scales: mx.array,
             backend: Optional[str] = None, tiles: Optional[int] = None) -> mx.array:
    """y + scales[s] * ((x @ lora_a[s].T) @ lora_b[s]) for each row with slot s = indices[row] (y where s is 0).
    x (T, IN), y (T, OUT) in the activations' dtype; lora_a (S, R, IN), lora_b (S, R, OUT); indices (T,)
    int32; scales (S,) float32. tiles: groups a row (default tiles_for's)."""
    rows, in_dims = x.shape
    out_dims = y.shape[1]
    vec = 16 // x.dtype.size  # elements a 16-byte load; a width that is no multiple is read one at a time
    vin, vout = (vec if n % vec == 0 else 1 for n in (in_dims, out_dims))
    tiles = tiles or tiles_for(rows, out_dims)
    step = THREADS * vout
    chunk = -(-out_dims // (tiles * step)) * step  # output columns a group
    template = [("T", x.dtype), ("IN", in_dims), ("OUT", out_dims), ("R", lora_a.shape[1]), ("VIN", vin),
                ("VOUT", vout), ("CHUNK", chunk)]
    return _kernel(backend or build.gpu_backend())(
        inputs=[x, y, lora_a, lora_b, indices, scales], template=template,
        grid=(-(-out_dims // chunk) * THREADS, rows, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, out_dims)], output_dtypes=[y.dtype])[0]


def check_add_lora(backend: str, dtype: mx.Dtype = mx.bfloat16, seed: int = 0) -> Optional[str]:
    """The kernel against the same products in float64 (numpy) on a random case: rows of three
    adapters and of none, ranks padded with zeros, an output width that is no multiple of the tile, at
    three tilings.
    None if it agrees within the dtype's tolerance, else what differs."""
    rng = np.random.default_rng(seed)
    rows, in_dims, out_dims, slots, rank = 9, 600, 1300, 4, 20  # ranks in two chunks, rows and tiles partial
    x = rng.standard_normal((rows, in_dims)) / 4
    y = rng.standard_normal((rows, out_dims))
    a = rng.standard_normal((slots, rank, in_dims)) / 8
    b = rng.standard_normal((slots, rank, out_dims)) / 2
    a[0], b[0], a[2, 5:], b[2, 5:] = 0, 0, 0, 0  # slot 0 empty; slot 2 of rank 5
    idx = np.array([0, 1, 2, 3, 1, 0, 3, 3, 2], np.int32)
    scales = np.array([0, 2.0, 0.5, 1.25], np.float32)
    want = y + scales[idx, None] * np.einsum("tr,tro->to", np.einsum("ti,tri->tr", x, a[idx]), b[idx])
    args = [mx.array(v.astype(np.float32)).astype(dtype) for v in (x, y, a, b)]
    for tiles in sorted({1, 2, tiles_for(rows, out_dims)}):  # tiles of 1300, 768 and 256 columns (bf16)
        got = add_lora(*args, mx.array(idx), mx.array(scales), backend=backend, tiles=tiles)
        got = np.array(got.astype(mx.float32))
        if not np.array_equal(got[idx == 0], np.array(args[1].astype(mx.float32))[idx == 0]):
            return f"rows without an adapter differ from the base output ({tiles} groups a row)"
        tol = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 4e-2}[dtype]
        err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))
        if not (np.isfinite(err) and err <= tol):
            return f"max relative difference {err:.2e} > {tol:.0e} ({tiles} groups a row)"
    return None
