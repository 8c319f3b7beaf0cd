"""What one decode step's weight reads cost at each batch size: MLX's matmul on Llama-8B's layer shapes.

A decode step is bandwidth-bound when every weight byte is read once at the machine's copy speed.
This times the seven projections of one Llama-8B layer (q, k, v, o, gate, up, down; bf16) for M
rows, chained over --layers layers in one graph, and prints the time against that ideal, so that
a step slower than its roofline can be split into what the matmuls cost and what the rest costs.

  python scripts/bench/bench_matmul.py --batch-sizes 1 8 32 64 128 256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.timing import measure_bandwidth, timed  # noqa: E402

# (out, in) of Llama-8B's projections, in the order a layer runs them.
SHAPES = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    bw = measure_bandwidth()
    weights = [[(mx.random.normal(s) * 0.02).astype(dtype) for s in SHAPES] for _ in range(args.layers)]
    mx.eval(weights)
    nbytes = sum(w.nbytes for layer in weights for w in layer)
    ideal = nbytes / bw
    print(f"device {mx.default_device()}, copy bandwidth {bw / 1e9:.0f} GB/s, {args.layers} layers "
          f"({nbytes / 1e9:.2f} GB of weights), {time.strftime('%Y-%m-%d')}")
    print(f"{'batch':>6} {'ms':>8} {'ideal ms':>9} {'x ideal':>8} {'GB/s':>7}")
    for m in args.batch_sizes:
        x0 = (mx.random.normal((m, 4096)) * 0.1).astype(dtype)
        mx.eval(x0)

        def step():
            x, kv = x0, []
            for q, k, v, o, gate, up, down in weights:
                kv += [x @ k.T, x @ v.T]
                h = (x @ q.T) @ o.T
                x = (mx.sigmoid(x @ gate.T) * (x @ up.T)) @ down.T + h
                x = x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + 1e-5)
            return [x, *kv]

        t = timed(step, args.iters)
        print(f"{m:>6} {t * 1e3:8.3f} {ideal * 1e3:9.3f} {t / ideal:8.2f} {nbytes / t / 1e9:7.0f}")


if __name__ == "__main__":
    main()
