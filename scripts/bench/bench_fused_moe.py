"""A MoE layer's experts (gate, up, activation, down) through the fused MoE kernel (kernels/fused_moe.py) against
mlx-lm's SwitchGLU on MLX's gather_qmm, same weights and routing, per token count, on the device: microseconds a
layer (the device's kernel time through CUPTI where torch is installed, else a chain's wall time), the ratio and the
largest difference between the two outputs. The default widths are Qwen3.6-35B-A3B's (256 experts of 2048 x 512, 8
a token), routed at random.

  python scripts/bench/bench_fused_moe.py --tokens 1 8 64 256 [--bits 4 --group-size 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx import platform  # noqa: E402
from pagedmlx.layers import fused_moe, quantized_linear  # noqa: E402
from scripts.bench.bench_quantized_gemm import device_us, timed  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=8, help="copies of the layer a chain cycles through (past L2)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--wall", action="store_true", help="wall time of a chain (the host's dispatch included)")
    args = p.parse_args()
    platform.use_kernel_cache()
    os.environ["PAGEDMLX_FUSED_MOE_MIN_TOKENS"] = "1"  # the kernel at every token count, for this study
    layers = []
    for _ in range(args.layers):
        glu = SwitchGLU(args.hidden, args.intermediate, args.experts)
        glu.set_dtype(mx.bfloat16)
        nn.quantize(glu, group_size=args.group_size, bits=args.bits)
        layers.append(glu)
    mx.eval([glu.parameters() for glu in layers])
    model = nn.Module()
    model.layers = layers
    fused_moe.fuse_switch_glus(model)
    start = time.perf_counter()
    if fused_moe.use_fused_moe(True, model, True) != args.layers:
        sys.exit("the fused MoE kernel did not pass its check (see the warning above)")
    print(f"  fused MoE kernel checked in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    timing = "wall time of chains" if args.wall or device_us(lambda: None) is None else "device time (CUPTI)"
    print(f"{mx.default_device()}  {args.experts} experts of {args.hidden} x {args.intermediate}, {args.top_k} a "
          f"token, {args.bits}-bit g{args.group_size}, bf16  {timing}")
    print(f"{'tokens':>6} {'gather_qmm us':>14} {'fused us':>9} {'speed-up':>9} {'max diff':>9}")
    for tokens in args.tokens:
        x = mx.random.normal((tokens, 1, args.hidden), mx.bfloat16)
        route = mx.argsort(mx.random.uniform(shape=(tokens, 1, args.experts)), axis=-1)[..., :args.top_k]
        mx.eval(x, route)

        def run(i: int, on: bool) -> mx.array:
            if not on:
                return layers[i % args.layers](x, route)
            with quantized_linear.flat_rows():
                return layers[i % args.layers](x, route)

        gather_us = timed(lambda i: run(i, False), args.layers * 2, args.repeats, args.wall)
        fused_us = timed(lambda i: run(i, True), args.layers * 2, args.repeats, args.wall)
        want, got = run(0, False).astype(mx.float32), run(0, True).astype(mx.float32)
        diff = (mx.abs(got - want).max() / mx.abs(want).max()).item()
        print(f"{tokens:>6} {gather_us:>14.1f} {fused_us:>9.1f} {gather_us / fused_us:>8.2f}x {diff:>9.1e}", flush=True)


if __name__ == "__main__":
    main()
