"""What a new prefill shape costs MLX's fused causal SDPA: the first call at a (queries, keys) shape
against later calls at the same shape. On CUDA, MLX builds a cuDNN graph per shape (and strides)
and keeps 256 in an LRU cache, so a serving engine whose chunk lengths vary pays the build on
every new length. Llama-8B heads (32 query, 8 KV, 128 dims), bf16.
Then an alternative the engine does not take, and why: keys rounded up to coarse buckets (four per
doubling) under an explicit causal mask, so that a long prefill's steps share a shape, against the
fused causal call at the exact key count (warm, ms per call): on the H200 the masked call was 2-9x
slower (run 27), so the engine pads to the quantum only and builds the shapes at start-up instead.

  python scripts/bench/bench_sdpa_shapes.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.timing import timed  # noqa: E402

SHAPES = [(2048, 2048), (2048, 4096), (1712, 3968), (3968, 3968), (256, 256), (2047, 6015), (8192, 8192),
          (8192, 32000), (2048, 2048 + 16), (2048 + 16, 2048 + 16)]


def first_call(q, k, v) -> float:
    t = time.perf_counter()
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask="causal"))
    return time.perf_counter() - t


def main() -> None:
    H, Hkv, D, dtype = 32, 8, 128, mx.bfloat16
    print(f"bench_sdpa_shapes on {mx.default_device()}, {time.strftime('%Y-%m-%d')}, H={H} Hkv={Hkv} D={D} bf16")
    print(f"{'queries':>8} {'keys':>7} | {'first ms':>9} {'again ms':>9} {'first - again':>13}")
    w = mx.random.normal((1, H, 64, D)).astype(dtype)
    first_call(w, w[:, :Hkv], w[:, :Hkv])  # library start-up, not a shape's cost
    extra = []
    for L, S in SHAPES:
        q = mx.random.normal((1, H, L, D)).astype(dtype)
        k = mx.random.normal((1, Hkv, S, D)).astype(dtype)
        v = mx.random.normal((1, Hkv, S, D)).astype(dtype)
        mx.eval(q, k, v)
        cold = first_call(q, k, v)
        warm = timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask="causal"), 10)
        extra.append(cold - warm)
        print(f"{L:>8} {S:>7} | {1e3 * cold:9.2f} {1e3 * warm:9.2f} {1e3 * (cold - warm):13.2f}")
    print(f"median cost of a new shape: {1e3 * statistics.median(extra):.1f} ms")
    bucketed_vs_causal(H, Hkv, D, dtype)


def bucketed_vs_causal(H: int, Hkv: int, D: int, dtype) -> None:
    from pagedmlx.runner.attention_metadata import causal_mask

    print(f"{'queries':>8} {'keys':>7} {'bucket':>7} | {'causal ms':>9} {'bucketed ms':>11} {'ratio':>6}")
    for L, S in [(128, 4000), (512, 4000), (128, 16000), (512, 16000), (512, 30000), (2048, 30000)]:
        step = 256 * max(1, (1 << ((S // 256).bit_length() - 1)) // 4)
        B = -(-S // step) * step
        q = mx.random.normal((1, H, L, D)).astype(dtype)
        k = mx.random.normal((1, Hkv, B, D)).astype(dtype)
        v = mx.random.normal((1, Hkv, B, D)).astype(dtype)
        mask = causal_mask(mx.arange(B)[None], mx.arange(S - L, S)[:, None], None)
        mx.eval(q, k, v, mask)
        exact = timed(lambda: mx.fast.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S], scale=0.088,
                                                                   mask="causal"), 10)
        bucketed = timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask=mask), 10)
        print(f"{L:>8} {S:>7} {B:>7} | {1e3 * exact:9.2f} {1e3 * bucketed:11.2f} {bucketed / exact:6.2f}")


if __name__ == "__main__":
    main()
