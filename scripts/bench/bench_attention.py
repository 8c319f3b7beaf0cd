"""Decode attention over pages: the paged-decode kernel, the gather path and contiguous SDPA.

Prints, per case, milliseconds per layer call, the KV bytes read, the ideal time at the bandwidth
measured in the same run, and each path's ratio to that ideal. Each timing chains --layers calls
in one graph (each call's output is the next call's query, as layers follow each other in a step)
and divides by the count: the median of --iters such graphs. One call per eval would mostly time
the launch and the host round trip, not the kernel.

  python scripts/bench/bench_attention.py                 # B=32 x 4096 keys, Llama-8B heads, bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.kernels import build, decode_attention  # noqa: E402
from pagedmlx.runner.attention import _gather  # noqa: E402
from pagedmlx.bench.timing import measure_bandwidth, timed_chain  # noqa: E402


# (threads, unroll, prefetch, vectors per lane, heads per block, tensor cores): see decode_attention.Settings.
VARIANTS = [(128, 2, 1, 1, 0, 0), (128, 2, 1, 1, 2, 0), (128, 2, 1, 2, 2, 0), (256, 2, 1, 1, 0, 0),
            (128, 2, 1, 1, 0, 1)]
SETTINGS = ("threads", "unroll", "prefetch", "vectors", "heads_per_block", "mma")
DEFAULT = tuple(getattr(decode_attention.SETTINGS["cuda"], name) for name in SETTINGS)


def settings(variant: tuple) -> decode_attention.Settings:
    return dataclasses.replace(decode_attention.SETTINGS["cuda"], **dict(zip(SETTINGS, variant)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["32x4096", "1x32768", "256x256", "64x1024"],
                    help="BATCHxCONTEXT")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--layers", type=int, default=32, help="calls chained in one graph")
    ap.add_argument("--splits", type=int, nargs="*", default=[],
                    help="also time the default kernel with these KV split counts (chosen: num_splits)")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    bw = measure_bandwidth()
    print(f"device {mx.default_device()}, measured copy bandwidth {bw / 1e9:.0f} GB/s, {time.strftime('%Y-%m-%d')}")
    kernel = build.gpu_backend() is not None
    header = (f"{'case':>10} {'KV MB':>8} {'ideal ms':>9} {'kernel ms':>10} {'x ideal':>8} {'gather ms':>10} "
              f"{'x ideal':>8} {'contig ms':>10} {'x ideal':>8}")
    print(header)
    rng = np.random.default_rng(0)
    for case in args.cases:
        B, S = map(int, case.split("x"))
        bs, nkv, D, H = args.block_size, args.kv_heads, args.head_dim, args.heads
        nb = -(-S // bs)
        pages = B * nb
        k_pages = mx.random.normal((pages, nkv, bs, D)).astype(dtype)
        v_pages = mx.random.normal((pages, nkv, bs, D)).astype(dtype)
        table = mx.array(rng.permutation(pages).reshape(B, nb).astype(np.int32))
        lens = mx.full((B,), S, mx.int32)
        q = mx.random.normal((B, H, D)).astype(dtype)
        kv_bytes = 2 * B * S * nkv * D * dtype.size
        ideal = kv_bytes / bw
        scale = D ** -0.5
        mask = mx.ones((B, 1, 1, nb * bs), mx.bool_)

        def gather_path(x):
            k, v = _gather(k_pages, table), _gather(v_pages, table)
            return mx.fast.scaled_dot_product_attention(x[:, :, None, :], k, v, scale=scale, mask=mask)[:, :, 0]

        kc, vc = _gather(k_pages, table), _gather(v_pages, table)
        mx.eval(kc, vc)
        contiguous = lambda x: mx.fast.scaled_dot_product_attention(x[:, :, None, :], kc, vc, scale=scale)[:, :, 0]  # noqa
        t_gather = timed_chain(gather_path, q, min(args.layers, 4), args.iters)  # its copies are large
        t_contig = timed_chain(contiguous, q, args.layers, args.iters)
        t_kernel = float("nan")
        if kernel:
            splits, tokens = decode_attention.num_splits(B, nkv, S)
            tok = mx.array([tokens], mx.int32)
            variants = {}
            for v in dict.fromkeys(VARIANTS + [DEFAULT]):
                variants[v] = timed_chain(lambda x: decode_attention.paged_decode(
                    x, k_pages, v_pages, table, lens, scale, splits, tok, settings=settings(v)), q, args.layers,
                    args.iters)
            print(f"    variants {SETTINGS}: "
                  + ", ".join(f"{k}: {1e3 * v:.3f}" for k, v in variants.items()))
            by_split = {}
            for n in args.splits:
                per = mx.array([-(-S // n)], mx.int32)
                by_split[n] = timed_chain(lambda x: decode_attention.paged_decode(
                    x, k_pages, v_pages, table, lens, scale, -(-S // (-(-S // n))), per), q, args.layers, args.iters)
            if by_split:
                print(f"    splits (chosen {splits}): " + ", ".join(f"{n}: {1e3 * v:.3f}" for n, v in by_split.items()))
            t_kernel = variants[DEFAULT]
        print(f"{case:>10} {kv_bytes / 1e6:8.0f} {ideal * 1e3:9.3f} {t_kernel * 1e3:10.3f} {t_kernel / ideal:8.2f} "
              f"{t_gather * 1e3:10.3f} {t_gather / ideal:8.2f} {t_contig * 1e3:10.3f} {t_contig / ideal:8.2f}")


if __name__ == "__main__":
    main()
