"""Study: does running custom kernels make MLX's later cuBLASLt products slower in the same process? (Run 61, H100:
with --skinny-gemm, decodes of 8 requests ran 0.77x although an 8-row step takes no skinny product; the 2- and
4-row phases before it had. MLX's CUDA graph cache keys a graph by its nodes' kinds and edges, not shapes, and a
custom kernel is a kernel node where cuBLASLt's call is a captured child graph.)

In one process, phase by phase, each a compiled chain of --ops products over distinct 4,096 x 4,096 bf16 weights
(so nothing stays in L2), timed with the device drained first (ms inside mx.async_eval, ms until done; medians):

  before      the 8-row matmul chain (cuBLASLt), nothing else run yet
  custom      the 2-row then 4-row chain through the skinny GEMM kernel (as --skinny-gemm's decodes)
  after       the 8-row matmul chain again
  new stream  the same on a stream of its own (an empty graph cache, the same allocator)

If `after` is slower than `before` and `new stream` is not, the graph cache's state is the cause. Run it again with
MLX_USE_CUDA_GRAPHS=0: without graphs the phases should agree.

    python scripts/bench/study_graph_cache.py
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


def chain(weights: list, product):
    def run(x):
        for w in weights:
            x = product(x, w)
        return x
    return mx.compile(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=128)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    if build.gpu_backend() is None:
        sys.exit("study_graph_cache needs a GPU backend")
    k = 4096
    weights = [mx.random.uniform(-0.02, 0.02, (k, k)).astype(mx.bfloat16) for _ in range(args.ops)]
    mx.eval(weights)
    x = {m: mx.random.normal((m, k)).astype(mx.bfloat16) for m in (2, 4, 8)}
    matmul = chain(weights, lambda y, w: y @ w.T)
    skinny = chain(weights, lambda y, w: skinny_gemm.skinny_gemm(y, w, mma=False))
    print(f"study_graph_cache on {mx.default_device()}, {args.ops} products of 4,096 x 4,096 bf16 a chain, median of "
          f"{args.runs}, device drained first\n")
    print("| phase | chain | ms in mx.async_eval | ms until done |")
    print("|---|---|---:|---:|")

    def row(phase: str, name: str, fn, xs):
        host, wall = time_case(fn, xs, args.runs)
        print(f"| {phase} | {name} | {host:.2f} | {wall:.2f} |", flush=True)

    row("before", "matmul, 8 rows", matmul, x[8])
    row("custom", "skinny GEMM, 2 rows", skinny, x[2])
    row("custom", "skinny GEMM, 4 rows", skinny, x[4])
    row("after", "matmul, 8 rows", matmul, x[8])
    with mx.stream(mx.new_stream(mx.gpu)):
        row("new stream", "matmul, 8 rows", matmul, x[8])
    row("after, again", "matmul, 8 rows", matmul, x[8])


if __name__ == "__main__":
    main()
