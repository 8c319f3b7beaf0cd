"""What the batched-LoRA products cost on the device, op by op (issue 29: mixed adapters at batch 64 trail
the base model on the H200). Llama-8B's seven projections a layer, --layers layers, --rows rows (one decode
step at batch 64), --slots adapters of rank --rank side by side (layers.py's stacked form):

  base      x @ W^T, the projection itself
  shrink    x @ A_used^T                (rows, slots * rank)
  mask      a * column mask
  expand    (a * mask) @ B_used         (rows, out)
  epilogue  y + (scale * z).astype      (fused by mx.compile in layers.py)
  lora      all four above, as layers.py runs them after the base product on the CPU
  kernel    kernels/lora.py's one kernel for all four (a GPU only), as layers.py runs it there
  kernel tN the same with N groups a row (tiles of its output columns; each recomputes the row's shrink)
  kernel 0  the kernel with every row on slot 0 (no adapter): its launch and the copy of y, the floor
  empty     a custom kernel of one group that writes one value (a GPU only): what MLX's dispatch of any
            custom kernel and its launch cost, beside 'mask' (one of MLX's own ops)
  siblings  the kernel with q/k/v in one launch and gate/up in one (add_lora_siblings, as layers.py runs
            projections of one input): four launches a layer instead of seven

Each row: wall ms per step (all layers' ops of that kind, one mx.eval; median of --runs) and µs per op.
With --compile each case runs as one mx.compile'd function (its Python traced once, as the engine's compiled
decode steps replay it): what is left is the device's time, launches included, not the host's.

    python scripts/bench/study_lora_ops.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.kernels import build, lora as lora_kernel  # noqa: E402
from pagedmlx.kernels.dialect import render  # noqa: E402
from pagedmlx.lora.layers import _add_scaled  # noqa: E402

# Llama-8B: (in, out) of q, k, v, o, gate, up, down
PROJECTIONS = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]


def time_ms(fn, runs: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="each case traced once by mx.compile, then replayed")
    args = ap.parse_args()
    dt = getattr(mx, args.dtype)
    kr = args.slots * args.rank
    mx.random.seed(0)
    layers = []
    for _ in range(args.layers):
        for i, o in PROJECTIONS:
            layers.append(dict(x=mx.random.normal((args.rows, i)).astype(dt), w=mx.random.normal((o, i)).astype(dt),
                               a=mx.random.normal((kr, i)).astype(dt), b=mx.random.normal((kr, o)).astype(dt)))
    slot = mx.arange(args.rows) % args.slots
    mask = (slot[:, None] == (mx.arange(kr) // args.rank)[None, :]).astype(dt)
    scales = mx.full((args.rows, 1), 2.0, dt)
    for p in layers:  # the inputs of the later ops, computed once
        p["y"] = p["x"] @ p["w"].T
        p["s"] = p["x"] @ p["a"].T
        p["z"] = (p["s"] * mask) @ p["b"]
        if build.gpu_backend() is not None:  # the kernel's stacks: slot 0 empty, then the adapters
            (o, i), r = p["w"].shape, args.rank
            p["a3"] = mx.concatenate([mx.zeros((r, i), dt), p["a"]]).reshape(args.slots + 1, r, i)
            p["b3"] = mx.concatenate([mx.zeros((r, o), dt), p["b"]]).reshape(args.slots + 1, r, o)
    indices = (slot + 1).astype(mx.int32)
    slot_scales = mx.array([0.0] + [2.0] * args.slots)
    mx.eval(layers, mask, scales, indices, slot_scales)

    def lora(p):
        return _add_scaled(p["y"], scales, (((p["x"] @ p["a"].T) * mask) @ p["b"]))

    cases = {"base": lambda: [p["x"] @ p["w"].T for p in layers],
             "shrink": lambda: [p["x"] @ p["a"].T for p in layers],
             "mask": lambda: [p["s"] * mask for p in layers],
             "expand": lambda: [(p["s"] * mask) @ p["b"] for p in layers],
             "epilogue": lambda: [_add_scaled(p["y"], scales, p["z"]) for p in layers],
             "lora": lambda: [lora(p) for p in layers]}
    if build.gpu_backend() is not None:
        empty = build.make_kernel(build.gpu_backend(), "pagedmlx_study_empty", ["x"], ["out"],
                                  render("    if (THREAD_IN_GROUP == 0) out[0] = x[0];", build.gpu_backend()), "")
        cases["empty"] = lambda: [empty(inputs=[p["x"]], template=[("T", p["x"].dtype)], grid=(32, 1, 1),
                                        threadgroup=(32, 1, 1), output_shapes=[(1,)], output_dtypes=[p["x"].dtype])[0]
                                  for p in layers]
        no_rows = mx.zeros_like(indices)  # every row slot 0: the launch and the copy of y, no products
        cases["kernel 0"] = lambda: [lora_kernel.add_lora(p["x"], p["y"], p["a3"], p["b3"], no_rows, slot_scales)
                                     for p in layers]
        sib = [layers[i:i + 7] for i in range(0, len(layers), 7)]
        cases["siblings"] = lambda: [o for layer in sib for group in (layer[:3], layer[3:4], layer[4:6], layer[6:])
                                     for o in lora_kernel.add_lora_siblings(
                                         group[0]["x"], [p["y"] for p in group], [p["a3"] for p in group],
                                         [p["b3"] for p in group], indices, slot_scales)]
        for tiles in (None, 1, 2, 4, 8):  # None: lora.tiles_for's choice, as layers.py runs it
            cases["kernel" if tiles is None else f"kernel t{tiles}"] = functools.partial(
                lambda t: [lora_kernel.add_lora(p["x"], p["y"], p["a3"], p["b3"], indices, slot_scales, tiles=t)
                           for p in layers], tiles)
    print(f"study_lora_ops on {mx.default_device()}, {time.strftime('%Y-%m-%d %H:%M')}: {args.rows} rows, "
          f"{args.layers} Llama-8B layers ({len(layers)} projections), {args.slots} slots of rank {args.rank}, "
          f"{args.dtype}, median of {args.runs}{', compiled' if args.compile else ''}")
    print(f"{'case':>9} | {'ms a step':>9} | {'µs an op':>8} | {'vs base':>7}")
    base = None
    for name, fn in cases.items():
        if args.compile:
            fn = functools.partial(mx.compile(lambda _, f=fn: f()), mx.array(0))
        ms = time_ms(fn, args.runs)
        base = base or ms
        print(f"{name:>9} | {ms:9.2f} | {1e3 * ms / len(layers):8.1f} | {ms / base:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
