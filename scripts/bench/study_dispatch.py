"""Study: what MLX's host side costs per primitive, by kind, with nothing queued on the device (issue 28: a
speculative round's verifying step spends ~9.5 ms inside mx.async_eval on an H100 with the device idle, where a
one-row decode step of the same model and op count takes ~6 ms in all; run 58's drained phases).

The suspect: on CUDA, MLX (0.32) runs a matmul of one row as its own gemv kernel, and one of 2+ rows through
cuBLASLt, building a CublasGemm each call (a matmul descriptor and three layouts), asking cublasLt's heuristic
for an algorithm each call, and capturing the cublasLt call into its CUDA graph. A verifying step of 1 + k rows
makes ~130 such matmuls on Llama-8B; so does every decode step of 2 to ~32 requests.

Each case chains --ops primitives of one kind in one mx.compile'd function (as the engine's compiled steps
replay theirs), runs it once to trace, then --runs times: mx.synchronize, the time inside mx.async_eval
(host: MLX's eval_gpu of each primitive, the graph's build and launch), then the time until the result is done.
Printed per primitive, medians. Kinds:

  gemv     (1, K) @ W^T                      MLX's gemv kernel
  gemm M   (M, K) @ W^T, M in --rows         cuBLASLt
  rms      mx.fast.rms_norm over (M, K)      one of MLX's own kernels, for scale
  custom   a custom kernel of one group that copies one value (a GPU only): mx.fast.cuda_kernel's dispatch
  skinny M kernels/skinny_gemm.py's product of M rows (a GPU only; bfloat16 / float32): what
           EngineConfig.skinny_gemm puts in place of cuBLASLt's

    python scripts/bench/study_dispatch.py                # GPU: K 4096, W 4096 x 4096 bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.kernels import build, skinny_gemm  # noqa: E402
from pagedmlx.kernels.dialect import render  # noqa: E402


def chain(step, ops: int):
    """A compiled function applying `step` ops times to its input."""
    def run(x):
        for _ in range(ops):
            x = step(x)
        return x
    return mx.compile(run)


def time_case(fn, x: mx.array, runs: int) -> tuple[float, float]:
    """(ms inside mx.async_eval, ms until done), medians over runs, the device drained before each."""
    mx.eval(fn(x))
    host, wall = [], []
    for _ in range(runs):
        mx.synchronize()
        t = time.perf_counter()
        y = fn(x)
        mx.async_eval(y)
        t1 = time.perf_counter()
        mx.eval(y)
        host.append(t1 - t)
        wall.append(time.perf_counter() - t)
    return 1e3 * statistics.median(host), 1e3 * statistics.median(wall)


def cases(k: int, rows: list[int], dtype: mx.Dtype) -> dict:
    """{name: (step, input)}: each step maps its input to an array of the same shape."""
    w = (mx.random.normal((k, k)) * k ** -0.5).astype(dtype)
    out = {"gemv": (lambda x: x @ w.T, mx.random.normal((1, k)).astype(dtype))}
    for m in rows:
        out[f"gemm {m}"] = (lambda x: x @ w.T, mx.random.normal((m, k)).astype(dtype))
    norm_w = mx.ones((k,), dtype)
    out[f"rms {rows[-1]}"] = (lambda x: mx.fast.rms_norm(x, norm_w, 1e-5), mx.random.normal((rows[-1], k)).astype(dtype))
    backend = build.gpu_backend()
    if backend is not None:
        copy = build.make_kernel(backend, "pagedmlx_study_copy", ["x"], ["out"],
                                 render("    if (THREAD_IN_GROUP == 0) out[0] = x[0];", backend), "")
        out["custom"] = (lambda x: copy(inputs=[x], template=[("T", x.dtype)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                                        output_shapes=[x.shape], output_dtypes=[x.dtype])[0],
                         mx.random.normal((1, k)).astype(dtype))
        for m in rows:
            if skinny_gemm.supports(m, w):
                out[f"skinny {m}"] = (lambda x: skinny_gemm.skinny_gemm(x, w), mx.random.normal((m, k)).astype(dtype))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4096, help="the width (W is k x k)")
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 5, 8, 16, 64])
    ap.add_argument("--ops", type=int, default=128, help="primitives a case chains")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    print(f"study_dispatch on {mx.default_device()}, {args.dtype}, K {args.k}, {args.ops} primitives a case, "
          f"median of {args.runs}, device drained before each\n")
    print("| case | µs / primitive in mx.async_eval | µs / primitive until done |")
    print("|---|---:|---:|")
    for name, (step, x) in cases(args.k, args.rows, dtype).items():
        host, wall = time_case(chain(step, args.ops), x, args.runs)
        print(f"| {name} | {1e3 * host / args.ops:.1f} | {1e3 * wall / args.ops:.1f} |", flush=True)


if __name__ == "__main__":
    main()
