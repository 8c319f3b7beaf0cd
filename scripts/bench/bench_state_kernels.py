"""The gated delta kernel (kernels/recurrent_state.py) against mlx-lm's gated_delta_ops (on CUDA a
Python loop over tokens of a compiled one-step function), on the GPU machine: Qwen3.5-27B's linear
attention heads (16 key heads, 48 value heads, 128 x 128), bf16, a decode batch of 64 and prefill
chunks of 512 and 2,048 tokens, milliseconds per call (mean of 5 after one warm-up). The kernels'
correctness: tests/test_state_kernels.py.

    python scripts/bench/bench_state_kernels.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.kernels import build, recurrent_state  # noqa: E402


def inputs(B, T, Hk, Hv, Dk, Dv, dtype, vec=False):
    from mlx_lm.models.gated_delta import normalize_qk

    q, k = (mx.random.normal((B, T, Hk, Dk)).astype(dtype) for _ in range(2))
    q, k = normalize_qk(q, k, inv_scale=Dk ** -0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv)).astype(dtype)
    g = mx.random.uniform(0.8, 1.0, (B, T, Hv, Dk) if vec else (B, T, Hv))
    beta = mx.random.uniform(0, 1, (B, T, Hv)).astype(dtype)
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q, k, v, g, beta, state


def timing() -> None:
    from mlx_lm.models.gated_delta import gated_delta_ops

    for shape in ((64, 1, 16, 48, 128, 128), (1, 512, 16, 48, 128, 128), (1, 2048, 16, 48, 128, 128)):
        args = inputs(*shape, mx.bfloat16)
        mx.eval(args)
        for name, fn in (("mlx-lm ops", gated_delta_ops), ("kernel", recurrent_state.gated_delta)):
            mx.eval(fn(*args))
            t = time.perf_counter()
            for _ in range(5):
                mx.eval(fn(*args))
            print(f"time gated_delta {shape} bf16 {name}: {(time.perf_counter() - t) / 5 * 1e3:.2f} ms")


def main() -> int:
    if build.gpu_backend() != "cuda":
        print("no CUDA device: run this on the GPU machine")
        return 2
    mx.random.seed(0)
    timing()
    return 0


if __name__ == "__main__":
    sys.exit(main())
