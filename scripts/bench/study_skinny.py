"""Study: the skinny GEMM's device time against cuBLASLt's at Llama-8B's widths (issue 28; run 59: the lanes' kernel
took 2-8 rows' products off cuBLASLt's 25 µs of host time a call, but at 8 rows its device time cost more than it
saved: decode 0.72x at 8 requests).

One case is a decode step's products over --layers distinct layers (weights that do not fit in L2 together): per
layer q/k/v merged (6,144 x 4,096), o (4,096 x 4,096), gate/up merged (28,672 x 4,096) and down (4,096 x 14,336),
computed by MLX's matmul (cuBLASLt from 2 rows; gemv at 1), the lanes' kernel (K unsplit, split 2 ways, or as
k_split picks per product: from 4 rows Llama-8B's q/k/v, o and down 4 ways, gate/up 2; unsplit below), or the tensor-core kernel at a
(warps, unroll) launch. Timed with the device drained before each run: ms inside mx.async_eval (host), ms until
done, and the weights' bytes over the time until done. Each kernel is first held to MLX's matmul (max relative
difference, the load-time check's measure).

    python scripts/bench/study_skinny.py                       # GPU: rows 1 2 4 5 8, 32 layers
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from study_dispatch import time_case  # noqa: E402

from pagedmlx.kernels import build, skinny_gemm  # noqa: E402

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # Llama-8B, merged as decode runs them
MMA_LAUNCHES = ((8, 4), (16, 1))  # (warps, unroll): run 60's best of five


def products(kind: str, layers: list, xs: dict, **launch) -> list:
    if kind == "matmul":
        return [xs[w.shape[1]] @ w.T for layer in layers for w in layer]
    return [skinny_gemm.skinny_gemm(xs[w.shape[1]], w, mma=kind == "mma", **launch) for layer in layers for w in layer]


def max_difference(got: list, want: list) -> float:
    return max((mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max()
                / mx.maximum(mx.abs(w.astype(mx.float32)).max(), 1e-6)).item() for g, w in zip(got, want))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    if build.gpu_backend() is None:
        sys.exit("study_skinny needs a GPU backend")
    layers = [[mx.random.uniform(-0.02, 0.02, s).astype(mx.bfloat16) for s in SHAPES] for _ in range(args.layers)]
    mx.eval(layers)
    gib = sum(w.nbytes for layer in layers for w in layer) / 2 ** 30
    print(f"study_skinny on {mx.default_device()}, bfloat16, {args.layers} Llama-8B layers ({gib:.1f} GiB of weights), "
          f"median of {args.runs}, device drained before each\n")
    print("| rows | kernel | host ms | ms until done | GB/s | vs matmul (until done) | max rel. difference |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for rows in args.rows:
        xs = {k: mx.random.normal((rows, k)).astype(mx.bfloat16) for k in {s[1] for s in SHAPES}}
        want = products("matmul", layers[:1], xs)
        cases = [("matmul", "matmul", {})]
        if rows >= skinny_gemm.MIN_ROWS:
            cases += [("lanes, K unsplit", "lanes", {"split": 1}), ("lanes, K split 2", "lanes", {"split": 2}),
                      ("lanes, k_split", "lanes", {})] + [(f"mma w{w} u{u}", "mma", {"warps": w, "unroll": u})
                                                          for w, u in MMA_LAUNCHES]
        base = None
        for name, kind, launch in cases:
            diff = "" if kind == "matmul" else f"{max_difference(products(kind, layers[:1], xs, **launch), want):.1e}"
            host, wall = time_case(lambda _: products(kind, layers, xs, **launch), None, args.runs)
            base = base or wall
            print(f"| {rows} | {name} | {host:.2f} | {wall:.2f} | {gib * 2 ** 30 / wall / 1e6:.0f} | "
                  f"{base / wall:.2f}x | {diff} |", flush=True)


if __name__ == "__main__":
    main()
