"""The products of quantized linear layers over a step's rows as one launch of our own on CUDA: MLX's affine 4- and
8-bit weights dequantized in registers, multiplied on tensor cores (sources/quantized_gemm_cuda.py).

Why: MLX's CUDA quantized matmul (0.32) multiplies 2-256 rows with its tiled kernel (qmm_sm80), which on an H100
drew a few hundred GB/s of a 4-bit Llama-8B's weights at 64 rows: its steps took twice bf16's. This kernel reads
each weight once for up to 64 rows. Where it runs is decided at load (check_quantized_gemm against MLX's quantized
matmul at the model's widths)."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from pagedmlx.kernels import build, check, launch_configs
from pagedmlx.kernels.dialect import CUDA, render
from pagedmlx.kernels.sources import decode_attention_mma_cuda as mma_src
from pagedmlx.kernels.sources import prefill_attention_cuda as prefill_src
from pagedmlx.kernels.sources import quantized_gemm_cuda as src

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.bfloat16, mx.float16)
TOLERANCE = {mx.bfloat16: 2e-2, mx.float16: 4e-3}  # relative to the output's largest magnitude
MAX_ROWS = 256  # x's rows a launch takes; more (long prefill chunks) take MLX's quantized matmul
MAX_TILES = 8  # 8-row tiles of x a thread block takes (MT): more rows launch more blocks, each reading the weights
WARPS = 8  # warps a thread block (WN), each 16 columns: a chunk of x staged in shared memory serves 128 columns
BLOCKS = 264  # thread blocks a product is split up to along K (two an SM of an H100's 132)
X_SLOTS_BYTES = 40 << 10  # shared memory the ST slots of x take at most by default (stages_for)
MAX_STAGES = 4  # chunks in flight (ST): registers a chunk's weights take in each of its slots bound it
COUNTERS = 1 << 20  # the ring of split tiles' counters (4 MB): a step's launches take about 15k at 256 rows


@dataclass(frozen=True)
class Launch:
    """A launch's shape: 8-row tiles of x a block takes (mt), warps a block (wn, 16 columns each), splits of K
    (ks: blocks along grid z, whose float32 partial sums are added), chunks in flight (st, 2 or more)."""

    mt: int
    wn: int
    ks: int
    st: int = 0  # 0: stages_for(mt)

    @property
    def stages(self) -> int:
        return self.st or stages_for(self.mt)


def stages_for(mt: int) -> int:
    """Chunks in flight for blocks of mt row tiles: MAX_STAGES, fewer where ST slots of x (mt * 2,560 bytes each)
    would pass X_SLOTS_BYTES."""
    return max(2, min(MAX_STAGES, X_SLOTS_BYTES // x_slot_bytes(mt)))


def x_slot_bytes(mt: int) -> int:
    """Shared memory one chunk of x takes at mt row tiles: 8 mt rows of 320 bytes (128 values and 64 bytes that
    keep a quarter warp's reads off each other's banks)."""
    return mt * 8 * 20 * 16


def k_splits(n: int, k: int) -> int:
    """Splits of K where no tuned config says (launch_for): up to BLOCKS thread blocks (at one row tile), each taking
    at least 4 of K's 128-wide chunks. Never from the rows, so that a row's sums are the same at any M."""
    blocks, chunks, ks = -(-n // (16 * WARPS)), -(-k // 128), 1
    while ks < 8 and blocks * ks * 2 <= BLOCKS and chunks >= 4 * ks * 2:
        ks *= 2
    return ks


@functools.lru_cache(maxsize=4096)  # a step asks once a product: the host's dispatch bounds batched 4-bit steps
def launch_for(n: int, k: int, rows: int, bits: int, group_size: int) -> Launch:
    """The launch for a product of `rows` rows against an (N, K) weight of this format: the tuned config's launch
    for the fewest tuned rows at or above `rows` (the most, past them), else row tiles enough for the rows up to
    MAX_TILES, WARPS warps, stages_for's chunks in flight."""
    if (config := tuned(n, k, bits, group_size)) is not None:  # one ks for every row count, as k_splits
        tuned_rows = sorted(int(r) for r in config["rows"])
        mt, wn, st = config["rows"][str(next((r for r in tuned_rows if r >= rows), tuned_rows[-1]))]
        return Launch(mt, wn, int(config["ks"]), st)
    return Launch(row_tiles(rows), WARPS, k_splits(n, k))


def row_tiles(rows: int) -> int:
    """8-row tiles of x a block takes by default: enough for `rows` (a power of two) up to MAX_TILES."""
    mt = 1
    while mt < MAX_TILES and 8 * mt < rows:
        mt *= 2
    return mt


def tuned(n: int, k: int, bits: int, group_size: int) -> Optional[dict]:
    """This GPU's tuned launches for an (N, K) weight of this format (kernels/launch_configs.py): {"ks": splits of
    K, "rows": {row count: [mt, wn, st]}}; None where none was tuned."""
    return launch_configs.load("quantized_gemm").get("shapes", {}).get(f"{n},{k},{bits},{group_size}")


def quantized_gemm_source(rows: str = src.DENSE_ROWS) -> str:
    """The kernel's source with a rows prelude: DENSE_ROWS (a step's rows), GROUPED_ROWS (kernels/fused_moe.py)."""
    return render(rows + src.QUANTIZED_GEMM + src.END_ROWS, CUDA)


def _header() -> str:  # read at build time: tests stand in the emulator's PTX helpers
    return mma_src.MMA_HEADER + prefill_src.PREFILL_HEADER + src.QUANTIZED_GEMM_HEADER


@functools.lru_cache(maxsize=None)
def _kernel(shared_memory: int):
    """The kernel whose launches get `shared_memory` bytes of dynamic shared memory: one object per size, a
    function of the template (a module's size never changes)."""
    return build.make_kernel(CUDA, "pagedmlx_quantized_gemm", ["x", "w", "scales", "biases", "counters"],
                             ["y", "partials"], quantized_gemm_source(), _header(), shared_memory=shared_memory)


def _kernel_for(launch: Launch):
    return _kernel(launch.stages * x_slot_bytes(launch.mt))


class _CounterRing:
    """Zeroed int32 counters for split launches' tiles, a stretch a launch, from a ring made once. A launch's last
    blocks zero its stretch again, so no fill is launched (a step has ~160 split products and is bound by its
    launches). A stretch comes round again after COUNTERS counters' worth of later launches, many steps on, and a
    compiled decode step (runner/compiled_step.py) keeps the stretches its trace took for every replay. Both are
    safe because no two launches that share a stretch are in flight together: within a step each launch has its
    own, and a step's products all feed the tokens the next step's products read, so the steps run in order."""

    def __init__(self, size: int):
        self.size, self.lock, self.ring, self.next = size, threading.Lock(), None, 0

    def take(self, count: int) -> mx.array:
        with self.lock:
            if self.ring is None:
                self.ring = mx.zeros((self.size,), mx.int32)
                mx.eval(self.ring)
            start = self.next if self.next + count <= self.size else 0
            self.next = start + count
            return self.ring[start:start + count]


_counters = _CounterRing(COUNTERS)  # a split launch takes at most ~64k tiles (256 rows, 1-row tiles, 64 columns)


def supports(rows: int, k: int, dtype: mx.Dtype, bits: int, group_size: int, mode: str = "affine") -> bool:
    """The kernel takes `rows` rows of width K (input features) against weights of this format: MLX's affine
    quantization at BITS and GROUP_SIZES, 16-bit activations, K a whole number of 32-value runs."""
    return (1 <= rows <= MAX_ROWS and mode == "affine" and bits in BITS and group_size in GROUP_SIZES
            and dtype in DTYPES and k % 32 == 0 and k % group_size == 0)


def quantized_gemm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int,
                   launch: Optional[Launch] = None) -> mx.array:
    """x @ dequantize(w, scales, biases).T for x (..., K) and MLX's affine (w, scales, biases) of N rows, as
    mx.quantized_matmul(transpose=True) computes it up to the order of its float sums (supports() says which).
    launch: the launch's shape (default launch_for; studies)."""
    *lead, k = x.shape
    rows, n = x.size // k, w.shape[0]
    launch = launch or launch_for(n, k, rows, bits, group_size)
    row_blocks, col_blocks = -(-rows // (8 * launch.mt)), -(-n // (16 * launch.wn))
    split = launch.ks > 1  # the partials' workspace and the tiles' counters, else unused
    dtype = scales.dtype
    y = _kernel_for(launch)(
        inputs=[x.reshape(rows, k).astype(dtype), w, scales, biases,
                _counters.take(row_blocks * col_blocks) if split else _no_counters()],
        template=_template(dtype, bits, group_size, launch),
        grid=(row_blocks * 32 * launch.wn, col_blocks, launch.ks), threadgroup=(32 * launch.wn, 1, 1),
        output_shapes=[(rows, n), (launch.ks, rows, n) if split else (1,)],
        output_dtypes=[dtype, mx.float32])[0]
    return y.reshape(*lead, n)


@functools.lru_cache(maxsize=None)
def _no_counters() -> mx.array:  # an unsplit launch's counters, never read (past 8 bytes: build.device_constant)
    return mx.zeros((4,), mx.int32)


@functools.lru_cache(maxsize=4096)
def _template(dtype: mx.Dtype, bits: int, group_size: int, launch: Launch) -> list:
    return [("T", dtype), ("BITS", bits), ("GS", group_size), ("MT", launch.mt), ("WN", launch.wn), ("KS", launch.ks),
            ("ST", launch.stages)]


def prebuild(shapes: Sequence[tuple[int, int, int, int]], dtype: mx.Dtype, rows: Sequence[int],
             launches: Optional[Sequence[Launch]] = None) -> None:
    """Compile the kernel's variants for these (N, K, bits, group_size) shapes and row counts into the disk cache
    before their first launches (kernels/disk_cache.py), where the cache is on. launches: these launch shapes for every
    shape instead of launch_for's (studies)."""
    if not hasattr(_kernel(0), "prebuild"):
        return
    inputs = [(dtype, 2), (mx.uint32, 2), (dtype, 2), (dtype, 2), (mx.int32, 1)]
    _kernel(0).prebuild([(inputs, [dtype, mx.float32], _template(dtype, bits, group_size, launch))
                         for n, k, bits, group_size in shapes
                         for launch in (launches or [launch_for(n, k, r, bits, group_size) for r in rows])])


def check_rows(max_rows: int) -> tuple[int, ...]:
    """Row counts the load-time check takes: each row tile count (MT) a launch uses, a partial tile of each, and
    more rows than one block takes."""
    rows = {1, 2, 7, 9, 16, 17, 33, 64, 8 * MAX_TILES + 1, max_rows}
    return tuple(sorted(r for r in rows if r <= max_rows))


def check_quantized_gemm(shapes: Sequence[tuple[int, int, int, int]], dtype: mx.Dtype = mx.bfloat16,
                         rows_checked: Sequence[int] = check_rows(MAX_ROWS), seed: int = 0) -> Optional[str]:
    """The kernel against MLX's dequantized weights multiplied in float32 on the device (the same values
    mx.quantized_matmul multiplies; MLX's CPU product sums bfloat16 inputs less exactly than the kernel) for each
    (N, K, bits, group_size) in `shapes` (the model's, at load) and row count. None if every output agrees within
    the dtype's tolerance, else what differs."""
    try:
        return _check(shapes, dtype, rows_checked, seed)
    except Exception as exc:  # compilation or launch: MLX raises when the kernel is built or run
        return f"did not compile or run ({check.error_line(exc)})"


def reference_product(w: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int):
    """x -> x @ dequantize(w).T in float32 on the device, the check's reference. The weights are dequantized once and
    multiplied through cuBLAS: mx.quantized_matmul in float32 would JIT-build a kernel of MLX's for each row count on
    a first start (a minute of a large model's cold start). MLX's CUDA float32 matmul runs on TF32 (MLX_ENABLE_TF32),
    exact for x's 16-bit values but not for the weights': they are multiplied as a bfloat16 part (exact in TF32) and
    the rest."""
    dense = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size,
                          bits=bits).T
    high = dense.astype(mx.bfloat16).astype(mx.float32)
    low = dense - high
    return lambda x: x.astype(mx.float32) @ high + x.astype(mx.float32) @ low


def _check(shapes, dtype, rows_checked, seed) -> Optional[str]:
    prebuild(shapes, dtype, rows_checked)
    keys = iter(mx.random.split(mx.random.key(seed), len(shapes) * (1 + len(rows_checked))))
    for n, k, bits, group_size in shapes:
        w, scales, biases = mx.quantize(mx.random.normal((n, k), dtype, scale=k ** -0.5, key=next(keys)),
                                        group_size=group_size, bits=bits)
        reference = reference_product(w, scales, biases, bits, group_size)
        for rows in rows_checked:
            x = mx.random.normal((rows, k), dtype, key=next(keys))
            got = quantized_gemm(x, w, scales, biases, bits, group_size).astype(mx.float32)
            if why := disagreement(got, reference(x), dtype, f"{rows} rows x {k} @ {n} x {k}, {bits}-bit, group size "
                                   f"{group_size}"):
                return why
    return None


def disagreement(got: mx.array, want: mx.array, dtype: mx.Dtype, what: str) -> Optional[str]:
    """None where `got` is within the dtype's TOLERANCE of the float32 reference `want` (relative to its largest
    magnitude); else how far, and `what` was multiplied."""
    err = (mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-6)).item()
    if np.isfinite(err) and err <= TOLERANCE[dtype]:
        return None
    return f"max relative difference {err:.2e} > {TOLERANCE[dtype]:.0e} ({what}, {check._dtype_name(dtype)})"
