"""Study: a quantized product over T rows fed as one matrix (T, D) against T sequences of one token (T, 1, D),
the shape the runner's forward gives every layer. Times one Llama-8B layer's seven projections (affine, group
size 64) in each shape and format, bf16's matmul beside them, per layer (ms) and as GB/s of the weights' bytes
(read once a layer). MLX's CUDA quantized matmul runs (T, 1, D) as T one-row products (runner/quantized_linear.py).

  python scripts/bench/study_quant_rows.py --rows 1 8 64 256 --bits 4 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.bench_matmul import SHAPES  # noqa: E402
from scripts.bench.timing import timed  # noqa: E402


def weights(bits: int, group_size: int) -> list[tuple]:
    """Per projection: (w,) in bf16, or (w, scales, biases) quantized."""
    out = []
    for n, k in SHAPES:
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        out.append((w,) if bits == 16 else tuple(mx.quantize(w, group_size=group_size, bits=bits)))
    mx.eval(out)
    return out


def layer(ws: list[tuple], xs: dict[int, mx.array], bits: int, group_size: int) -> list[mx.array]:
    """xs: the input of each width (4096, 14336)."""
    return [xs[k] @ w[0].T if bits == 16 else
            mx.quantized_matmul(xs[k], *w, transpose=True, group_size=group_size, bits=bits)
            for (_, k), w in zip(SHAPES, ws)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8, 16], help="16: bf16 weights, MLX's matmul")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    print(f"one Llama-8B layer's projections on {mx.default_device()}, MLX {mx.__version__}")
    print(f"{'format':>7} {'rows':>5} {'(T, D) ms':>10} {'(T,1,D) ms':>11} {'ratio':>6} {'(T, D) GB/s':>12}")
    for bits in args.bits:
        ws = weights(bits, args.group_size)
        nbytes = sum(a.nbytes for w in ws for a in w)
        for t in args.rows:
            xs = {k: mx.random.normal((t, k)).astype(mx.bfloat16) for k in {k for _, k in SHAPES}}
            xs1 = {k: x[:, None] for k, x in xs.items()}
            mx.eval(xs, xs1)
            flat = timed(lambda: layer(ws, xs, bits, args.group_size), args.iters)
            rows = timed(lambda: layer(ws, xs1, bits, args.group_size), args.iters)
            name = "bf16" if bits == 16 else f"{bits}-bit"
            print(f"{name:>7} {t:>5} {1e3 * flat:>10.3f} {1e3 * rows:>11.3f} {rows / flat:>6.1f} "
                  f"{nbytes / flat / 1e9:>12.0f}", flush=True)


if __name__ == "__main__":
    main()
