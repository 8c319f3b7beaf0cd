"""MLX's own tiled quantized matmul built ahead, in worker processes at once, on a model's first start here.

On CUDA (compute capability 8 and up), MLX multiplies 8 rows or more of a quantized product with qmm_sm80, a
CUTLASS kernel that it builds with NVRTC the first time a process meets one of its row tiles (16, 32 or 64 rows) for
a format (activation dtype, bits, group size, mode), then keeps in MLX_PTX_CACHE_DIR under a module name of those
(mlx/backend/cuda/quantized/qmm/qmm_sm80.cu). Each build takes tens of seconds, and a process builds one at a time.
A quantized model's start meets every tile of its formats: the KV budget's profile step, and mlx-lm's own passes in
the load-time check. A 4-bit Llama-8B's first start on an H100 spent over a minute in that check alone.

building(model) launches, as the runner's first step, one process per (format, tile) whose module is not on disk
yet, each running one small product of that tile into a folder of its own, and waits for them where it ends (before
the first such product); what they built is then moved into the cache, each module whole (os.replace), so that
another process (a tensor-parallel rank doing the same) never reads half a file. Where a worker ran and its module is
not under the name expected here (another MLX), a marker stops this for that MLX version: its process builds what it
meets, as before.

    python -m pagedmlx.kernels.mlx_jit_warm DTYPE BITS GROUP_SIZE MODE ROWS    # a worker (worker_main)
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from pagedmlx import envs
from pagedmlx.kernels import build, compile_workers, disk_cache
from pagedmlx.kernels.dialect import CUDA

logger = logging.getLogger("pagedmlx")

TILES = (16, 32, 64)  # qmm_sm80's row tiles: max(16, min(64, next power of 2 of the rows))
TIMEOUT_S = 300
Format = tuple[str, int, int, str]  # (activation dtype's name, bits, group size, mode)

NAMES_DIFFER = "qmm_sm80-names-differ"  # the marker, in the cache folder (one per MLX version)


def module_name(fmt: Format, tile: int) -> str:
    dtype, bits, group_size, mode = fmt
    return f"qmm_sm80_tn_{dtype}_m{tile}_b{bits}_g{group_size}_{mode}"


def formats(model: nn.Module) -> set[Format]:
    """The formats of the model's affine-quantized layers that qmm_sm80 multiplies (4 and 8 bits; the activations'
    dtype is the scales')."""
    found = set()
    for _, m in model.named_modules():
        scales = m.get("scales") if isinstance(m, nn.Module) else None
        if (isinstance(scales, mx.array) and scales.dtype in (mx.float16, mx.bfloat16)
                and getattr(m, "mode", "affine") == "affine" and getattr(m, "bits", 0) in (4, 8)):
            found.add((str(scales.dtype).removeprefix("mlx.core."), m.bits, m.group_size, "affine"))
    return found


def _on_cuda_sm80() -> bool:
    if build.gpu_backend() != CUDA:
        return False
    return int(mx.device_info().get("compute_capability_major", 0)) >= 8


@contextlib.contextmanager
def building(model: nn.Module) -> Iterator[int]:
    """Build the model's missing qmm_sm80 modules in worker processes while the block runs (it gets how many were
    started); on leaving, wait for them (each stopped after TIMEOUT_S) and move their modules into the cache. A
    block that raises stops them."""
    cache = disk_cache.ptx_cache_dir()
    todo = _missing(model, cache)
    if not todo:
        yield 0
        return
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".qmm-", dir=cache) as tmp:  # beside the cache: os.replace stays atomic
        workers = [w for w in (_launch(fmt, tile, Path(tmp) / str(i)) for i, (fmt, tile) in enumerate(todo)) if w]
        if workers:
            logger.info("building %d of MLX's quantized matmul kernels in worker processes", len(workers))
        try:
            yield len(workers)
        except BaseException:
            for proc, *_ in workers:
                proc.kill()
            raise
        finally:
            _finish(workers, cache)


def _missing(model: nn.Module, cache: Path) -> list[tuple[Format, int]]:
    if not envs.MLX_PTX_CACHE_DIR or not _on_cuda_sm80() or (cache / NAMES_DIFFER).exists():
        return []
    todo = [(fmt, tile) for fmt in sorted(formats(model)) for tile in TILES
            if not disk_cache.ptx_path(cache, module_name(fmt, tile)).exists()]
    return todo[:compile_workers.WORKERS]


def _launch(fmt: Format, tile: int, folder: Path) -> Optional[tuple[subprocess.Popen, Format, int, Path]]:
    folder.mkdir(parents=True)
    try:
        proc = subprocess.Popen([sys.executable, "-m", __name__, *map(str, fmt), str(tile)],
                                env=compile_workers.child_env(MLX_PTX_CACHE_DIR=str(folder)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:  # no processes here: the engine builds them itself as it meets them
        logger.info("MLX's quantized matmul not built ahead", exc_info=True)
        return None
    return proc, fmt, tile, folder


def _finish(workers: list, cache: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    for proc, fmt, tile, folder in workers:
        try:
            ran = proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            ran = False
        if ran and not disk_cache.ptx_path(folder, module_name(fmt, tile)).exists():
            (cache / NAMES_DIFFER).touch()
        modules = sorted(folder.rglob("*.ptx")) if ran else []
        for ptx in modules:  # its names first, then the module: MLX reads the .txt once the .ptx exists
            dest = cache / ptx.relative_to(folder)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if ptx.with_suffix(".txt").exists():
                os.replace(ptx.with_suffix(".txt"), dest.with_suffix(".txt"))
            os.replace(ptx, dest)


def worker_main(argv: Sequence[str]) -> int:
    """One product of ROWS rows in this format (the smallest widths qmm_sm80 takes), so that MLX builds and keeps
    that tile's module."""
    dtype_name, bits, group_size, mode, rows = argv
    bits, group_size, rows = int(bits), int(group_size), int(rows)
    dtype = getattr(mx, dtype_name)
    k = 2 * max(64, group_size)
    w = mx.quantize(mx.random.normal((128, k)).astype(dtype), group_size=group_size, bits=bits, mode=mode)
    x = mx.random.normal((rows, k)).astype(dtype)
    mx.eval(mx.quantized_matmul(x, *w, transpose=True, group_size=group_size, bits=bits, mode=mode))
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
