"""The benchmarks' one way to time MLX work: median seconds of an evaluated call, after a warm-up."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx


def timed(fn, iters: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timed_chain(fn, q: mx.array, layers: int, iters: int) -> float:
    """Seconds per call of fn (B, H, D) -> (B, H, D), chained `layers` times in one graph."""
    def chain():
        x = q
        for _ in range(layers):
            x = fn(x)
        return x
    return timed(chain, iters) / layers


def measure_bandwidth(gb: float = 2.0) -> float:
    """Bytes per second of a large copy (read + write)."""
    x = mx.zeros((int(gb * 2**30) // 4,), mx.float32)
    mx.eval(x)
    t = timed(lambda: x + 1.0, 10)
    return 2 * x.nbytes / t
