"""The recurrent-state CUDA kernels against the portable path, on the GPU machine: the gated delta
rule against mlx-lm's gated_delta_ops (decode batches and prefill chunks, Qwen3.5-27B and 35B-A3B head
shapes, scalar and vector gates), the depthwise convolution against nn.Conv1d, and the in-place state
write against a scatter (also while another reference to the pool is alive, and read back by a later
graph). Outputs are poisoned with NaN, so an element a kernel never writes fails. Then times the gated
delta kernel against mlx-lm's per-token loop. Prints PASS/FAIL per case; exits non-zero on a failure.

    python scripts/gpu/gpu_check_state.py [--no-timing]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.kernels import build, recurrent_state  # noqa: E402
from pagedmlx.kernels.dialect import CUDA  # noqa: E402

TOL = {mx.float32: 2e-3, mx.float16: 2e-2, mx.bfloat16: 4e-2}
# (B, T, Hk, Hv, Dk, Dv): Qwen3.5-27B's linear attention (16 key heads, 48 value heads, 128 x 128),
# 35B-A3B's (16, 32), and odd sizes.
SHAPES = [(64, 1, 16, 48, 128, 128), (1, 512, 16, 48, 128, 128), (1, 2048, 16, 32, 128, 128),
          (7, 1, 16, 32, 128, 128), (3, 5, 2, 4, 64, 24), (2, 33, 1, 1, 256, 64)]


def rel(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    if mx.isnan(got).any().item():
        return float("inf")
    return (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()


def inputs(B, T, Hk, Hv, Dk, Dv, dtype, vec=False):
    from mlx_lm.models.gated_delta import normalize_qk

    q, k = (mx.random.normal((B, T, Hk, Dk)).astype(dtype) for _ in range(2))
    q, k = normalize_qk(q, k, inv_scale=Dk ** -0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv)).astype(dtype)
    g = mx.random.uniform(0.8, 1.0, (B, T, Hv, Dk) if vec else (B, T, Hv))
    beta = mx.random.uniform(0, 1, (B, T, Hv)).astype(dtype)
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q, k, v, g, beta, state


def check_gated_delta() -> int:
    from mlx_lm.models.gated_delta import gated_delta_ops

    failed = 0
    for shape in SHAPES:
        for dtype in (mx.float32, mx.bfloat16):
            for vec in (False, True):
                args = inputs(*shape, dtype, vec)
                want = gated_delta_ops(*args)
                got = recurrent_state.gated_delta(*args, init_value=float("nan"))
                err = max(rel(got[0], want[0]), rel(got[1], want[1]))
                ok = err <= TOL[dtype]
                failed += not ok
                print(f"{'PASS' if ok else 'FAIL'} gated_delta {shape} {dtype} vec_g={vec}: {err:.2e}")
    return failed


def check_conv() -> int:
    failed = 0
    for dtype in (mx.float32, mx.bfloat16):
        for C, K, bias, B, L in ((10240, 4, False, 64, 4), (10240, 4, False, 1, 515), (96, 4, True, 5, 11)):
            conv = nn.Conv1d(C, C, K, groups=C, bias=bias)
            conv.set_dtype(dtype)
            x = mx.random.normal((B, L, C)).astype(dtype)
            err = rel(recurrent_state.depthwise_conv1d(x, conv.weight, conv.get("bias"), init_value=float("nan")), conv(x))
            ok = err <= TOL[dtype]
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'} depthwise_conv C={C} K={K} bias={bias} B={B} L={L} {dtype}: {err:.2e}")
    return failed


def check_write_rows() -> int:
    failed = 0
    for dtype in (mx.float32, mx.bfloat16):
        pool = mx.random.normal((40, 48, 128, 128)).astype(dtype)
        mx.eval(pool)
        want = pool * 1  # a copy, made before the kernel writes the pool
        mx.eval(want)
        slots = mx.array([3, -1, 17, 39], mx.int32)
        values = mx.random.normal((4, 48, 128, 128)).astype(dtype)
        keep = pool  # a second reference: a scatter would copy; the kernel must still write this very array
        written = recurrent_state.write_rows(values, slots, pool)
        after = mx.depends(pool[mx.array([17])], written)  # a read ordered after the write in one graph
        mx.eval(written, after)
        want[mx.array([3, 17, 39])] = values[mx.array([0, 2, 3])]
        err = max(rel(keep, want), rel(after, want[17:18]))
        later = pool[39] + 0  # a later graph reads the written rows
        err = max(err, rel(later, want[39]))
        ok = err == 0.0
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} write_rows in place {dtype}: {err:.2e}")
    return failed


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args()
    if build.gpu_backend() != CUDA:
        print("no CUDA device: run this on the GPU machine")
        return 2
    mx.random.seed(0)
    failed = check_gated_delta() + check_conv() + check_write_rows()
    if not args.no_timing:
        timing()
    print(f"{failed} failed" if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
