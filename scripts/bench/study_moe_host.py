"""Where a decode step's host time goes in an MoE model at batch 64 (issue 26: the Qwen3.6-35B-A3B shape's
graph takes ~3x longer to build than dense Qwen3.5-27B's on the H200, run 39): the presets' layer structure
at tiny widths, so that what is timed is Python and graph construction, not the device.

For each preset: the whole model's decode step on mlx-lm's own caches (what BatchGenerator builds too)
and its MLP sublayers alone (mlx-lm's SwitchGLU MoE block, or the dense MLP), as CPU µs to build the graph
(time.thread_time, first quartile of --runs) and the graph's node count (export_to_dot: on CUDA about one
kernel launch each); for the MLPs also the CPU µs of dispatching their graph (mx.async_eval: on CUDA,
encoding every kernel) and the wall µs of the wait after it.

    python scripts/bench/study_moe_host.py --batch 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.bench_host_step import graph_nodes, quartile, tiny_model  # noqa: E402


def build_us(fn, runs: int) -> tuple[float, mx.array]:
    """First-quartile CPU µs of calling `fn` (graph construction only) and its last output."""
    times = []
    for _ in range(runs):
        t = time.thread_time()
        out = fn()
        times.append(time.thread_time() - t)
    return 1e6 * quartile(times), out


def dispatch_us(fn, runs: int) -> tuple[float, float]:
    """First-quartile CPU µs of mx.async_eval of `fn`'s built graph (encoding its kernels), and wall µs
    of the wait for it after that."""
    dispatch, wait = [], []
    for _ in range(runs):
        out = fn()
        t = time.thread_time()
        mx.async_eval(out)
        dispatch.append(time.thread_time() - t)
        t = time.perf_counter()
        mx.eval(out)
        wait.append(time.perf_counter() - t)
    return 1e6 * quartile(dispatch), 1e6 * quartile(wait)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["qwen3.5-27b-16l", "qwen3.6-35b-a3b-16l"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--runs", type=int, default=40)
    args = ap.parse_args()
    from mlx_lm.models.cache import make_prompt_cache

    print(f"study_moe_host on {mx.default_device()}, {time.strftime('%Y-%m-%d %H:%M')}: batch {args.batch}, "
          f"decode step, tiny widths, first quartile of {args.runs} builds")
    print(f"{'preset':>20} | {'step µs':>8} {'nodes':>6} | {'MLPs µs':>8} {'nodes':>6} {'share of step':>13} | "
          f"{'per MLP µs':>10} {'nodes':>5} | {'dispatch µs':>11} {'wait µs':>7}")
    for preset in args.presets:
        model = tiny_model(preset)
        lm = getattr(model, "language_model", model)
        layers = lm.model.layers
        cache = make_prompt_cache(model)
        mx.eval(model(mx.zeros((args.batch, 16), mx.int32), cache=cache))
        saved = [c.state for c in cache]
        mx.eval(saved)
        y = mx.zeros((args.batch, 1), mx.int32)

        def step():
            for c, s in zip(cache, saved):  # the prefilled caches each time: one step's graph, nothing piled up
                c.state = s
            return model(y, cache=cache)

        step_us, logits = build_us(step, args.runs)
        step_nodes = graph_nodes(logits)
        x = mx.zeros((args.batch, 1, lm.args.hidden_size), mx.float32)
        mx.eval(x)
        mlp_us, outs = build_us(lambda: [layer.mlp(x) for layer in layers], args.runs)
        mlp_nodes = graph_nodes(*outs)
        dispatch, wait = dispatch_us(lambda: [layer.mlp(x) for layer in layers], args.runs)
        n = len(layers)
        print(f"{preset:>20} | {step_us:8.0f} {step_nodes:6d} | {mlp_us:8.0f} {mlp_nodes:6d} "
              f"{mlp_us / step_us:12.0%} | {mlp_us / n:10.0f} {mlp_nodes // n:5d} | {dispatch:11.0f} {wait:7.0f}",
              flush=True)


if __name__ == "__main__":
    main()
