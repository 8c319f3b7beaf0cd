"""Study: what the skinny GEMM's load-time check costs at start-up, at Llama-8B's widths (run 64: engine start-up
33 s with the kernel against 10 s without). The check's inputs used to be drawn by numpy on the host (its
128,256-row head alone is 525 M normals); they are now drawn on the device. This times the numpy draw the check
used to make, then `check_skinny_gemm` as the engine calls it (the shapes `checked_shapes` gives, as at load), twice:
cold (kernels built, or read from MLX's PTX cache) and warm.

    python scripts/bench/study_skinny_check.py            # GPU
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.kernels import build, skinny_gemm  # noqa: E402
from pagedmlx.runner.skinny_linear import checked_shapes, rows_taken  # noqa: E402

# Llama-8B's products with q/k/v and gate/up merged (the GPU default): (N, K)
LLAMA_8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))


def main() -> None:
    backend, dtype = build.gpu_backend(), mx.bfloat16
    if backend is None:
        sys.exit("needs a GPU backend (the kernel runs on CUDA or Metal)")
    shapes = checked_shapes(LLAMA_8B, dtype)
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    for n, k in shapes:
        rng.standard_normal((n, k)).astype(np.float32)
    rows = [("numpy draw of the check's weights (before)", time.perf_counter() - t, "")]
    for label in ("check_skinny_gemm, cold", "check_skinny_gemm, warm"):
        t = time.perf_counter()
        why = skinny_gemm.check_skinny_gemm(backend, shapes, dtype, rows_checked=rows_taken())
        rows.append((label, time.perf_counter() - t, why or "passed"))
    print(f"{len(shapes)} shapes x rows {list(rows_taken())}, {backend}, {mx.default_device()}")
    print("| step | s | result |\n|---|---:|---|")
    for label, s, why in rows:
        print(f"| {label} | {s:.2f} | {why} |")


if __name__ == "__main__":
    main()
