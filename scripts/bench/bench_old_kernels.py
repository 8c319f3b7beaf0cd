"""The paged decode kernels against the kernels before the portable rewrite (commit 00010ee), on the
GPU machine: Llama-8B heads bf16, milliseconds per layer call (bench_attention's chained timing), lanes
and tensor cores, old and new; the new ones also with a 1,024-key window and with sinks. Old and new
outputs must agree too (exit status 1 if not). The correctness checks of the kernels themselves are
tests/test_gpu_kernels.py.

  mkdir OLD_DIR && for f in cuda_sources cuda_mma_sources; do
    git show 00010ee:pagedmlx/runner/$f.py > OLD_DIR/$f.py; done
  python scripts/bench/bench_old_kernels.py OLD_DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.kernels import build, decode_attention  # noqa: E402
from scripts.bench.timing import timed_chain  # noqa: E402

TOL = {mx.float32: 2e-3, mx.float16: 2e-2, mx.bfloat16: 4e-2}


def load_old_kernels(old_dir: str):
    """The kernels as they were before the portable rewrite (commit 00010ee), built from their source
    files, and their launch: paged_decode's arithmetic then, without window and sinks."""
    import runpy

    src = runpy.run_path(f"{old_dir}/cuda_sources.py")
    mma = runpy.run_path(f"{old_dir}/cuda_mma_sources.py")
    names = ["q", "k_pages", "v_pages", "block_table", "seq_lens", "split_tokens", "scale", "written"]
    kernels = {}
    for use_mma in (False, True):
        body, header = ((mma["ACCUMULATE_MMA"], src["HEADER"] + mma["MMA_HEADER"]) if use_mma
                        else (src["ACCUMULATE"], src["HEADER"]))
        tag = "old_decode_mma" if use_mma else "old_decode"
        kernels[use_mma] = (
            mx.fast.cuda_kernel(tag, names, ["out"], body + src["MERGE_WARPS"] + src["WRITE_OUT"], header=header),
            mx.fast.cuda_kernel(tag + "_split", names, ["part_acc", "part_m", "part_l"],
                                body + src["MERGE_WARPS"] + src["WRITE_SPLIT"], header=header),
            mx.fast.cuda_kernel("old_decode_merge", ["part_acc", "part_m", "part_l"], ["out"], src["MERGE"],
                                header=src["HEADER"]))
    consts = [mx.full((4,), 0.0, mx.float32), mx.zeros((4,), mx.int32)]

    def decode(q, k_pages, v_pages, table, lens, scale, splits, tok, use_mma):
        B, H, D = q.shape
        n_kv, bs = k_pages.shape[1], k_pages.shape[2]
        G = H // n_kv
        consts[0] = mx.full((4,), scale, mx.float32)
        inputs = [q, k_pages, v_pages, table, lens, tok, consts[0], consts[1]]
        if use_mma:
            threads = 32 * max(1, min(4, 256 // D))
            template = [("T", k_pages.dtype), ("D", D), ("G", G), ("BS", bs), ("THREADS", threads)]
            blocks = n_kv
        else:
            threads = 128
            tpt, vec = decode_attention.kernel_layout(D, G, k_pages.dtype)
            template = [("T", k_pages.dtype), ("D", D), ("G", G), ("R", 1), ("BS", bs), ("THREADS", threads),
                        ("TPT", tpt), ("VEC", vec), ("U", 2), ("PF", 1)]
            blocks = n_kv
        single, split, merge = kernels[use_mma]
        if splits == 1:
            return single(inputs=inputs, template=template, grid=(blocks * threads, B, 1),
                          threadgroup=(threads, 1, 1), output_shapes=[(B, H, D)], output_dtypes=[k_pages.dtype])[0]
        parts = split(inputs=inputs, template=template, grid=(blocks * threads, B, splits), threadgroup=(threads, 1, 1),
                      output_shapes=[(splits, B, H, D), (splits, B, H), (splits, B, H)],
                      output_dtypes=[mx.float32] * 3)
        return merge(inputs=parts, template=[("T", k_pages.dtype), ("D", D)], grid=(H * D, B, 1),
                     threadgroup=(D, 1, 1), output_shapes=[(B, H, D)], output_dtypes=[k_pages.dtype])[0]
    return decode


def bench_old(old_dir: str, layers: int = 32, iters: int = 20) -> bool:
    """Old kernels (before the portable source) against new, Llama-8B heads bf16, ms per layer call
    (bench_attention's chained timing); the new ones also with a 1024-key window and with sinks.
    Old and new outputs must agree too."""
    old = load_old_kernels(old_dir)
    lanes = dataclasses.replace(decode_attention.SETTINGS["cuda"], mma=0)
    mma = dataclasses.replace(decode_attention.SETTINGS["cuda"], mma=1)
    rng = np.random.default_rng(0)
    print(f"\nold (00010ee) vs new kernels, ms per layer call, {layers} chained calls, median of {iters}")
    print(f"{'case':>9} | {'lanes old':>9} {'lanes new':>9} {'new/old':>7} | {'mma old':>8} {'mma new':>8} "
          f"{'new/old':>7} | {'W=1024':>7} {'sinks':>7}")
    ok = True
    for B, S, dtype in [(32, 4096, mx.bfloat16), (1, 32768, mx.bfloat16), (256, 256, mx.bfloat16),
                        (64, 1024, mx.bfloat16), (32, 4096, mx.float32)]:
        H, n_kv, D, bs = 32, 8, 128, 16
        nb = -(-S // bs)
        k_pages = mx.random.normal((B * nb, n_kv, bs, D)).astype(dtype)
        v_pages = mx.random.normal((B * nb, n_kv, bs, D)).astype(dtype)
        table = mx.array(rng.permutation(B * nb).reshape(B, nb).astype(np.int32))
        lens = mx.full((B,), S, mx.int32)
        q = mx.random.normal((B, H, D)).astype(dtype)
        scale = D ** -0.5
        splits, tokens = decode_attention.num_splits(B, n_kv, S)
        tok = mx.array([tokens], mx.int32)
        sinks = mx.random.normal((H,))
        wsplits, wtokens = decode_attention.num_splits(B, n_kv, S, 1024)
        wtok = mx.array([wtokens], mx.int32)
        new = {name: (lambda x, st=st: decode_attention.paged_decode(x, k_pages, v_pages, table, lens, scale, splits,
                                                                  tok, settings=st))
               for name, st in (("lanes", lanes), ("mma", mma))}
        t = {}
        for name, use_mma in (("lanes", False), ("mma", True)):
            if use_mma and dtype == mx.float32:
                t[name + " old"] = t[name + " new"] = float("nan")
                continue
            fo = (lambda x, m=use_mma: old(x, k_pages, v_pages, table, lens, scale, splits, tok, m))
            diff = mx.abs(fo(q).astype(mx.float32) - new[name](q).astype(mx.float32)).max().item()
            ok &= bool(np.isfinite(diff) and diff <= TOL[dtype])
            t[name + " old"] = timed_chain(fo, q, layers, iters)
            t[name + " new"] = timed_chain(new[name], q, layers, iters)
        t["window"] = timed_chain(lambda x: decode_attention.paged_decode(
            x, k_pages, v_pages, table, lens, scale, wsplits, wtok, window=1024), q, layers, iters)
        t["sinks"] = timed_chain(lambda x: decode_attention.paged_decode(
            x, k_pages, v_pages, table, lens, scale, splits, tok, sinks=sinks), q, layers, iters)
        ms = {k: 1e3 * v for k, v in t.items()}
        print(f"{B:>4}x{S:<5}{'' if dtype == mx.bfloat16 else ' f32'} | {ms['lanes old']:9.3f} {ms['lanes new']:9.3f} "
              f"{ms['lanes new'] / ms['lanes old']:7.2f} | {ms['mma old']:8.3f} {ms['mma new']:8.3f} "
              f"{ms['mma new'] / ms['mma old']:7.2f} | {ms['window']:7.3f} {ms['sinks']:7.3f}")
    print("old and new agree" if ok else "FAIL: old and new kernels disagree")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old_dir", help="the kernel sources before the portable rewrite (see above)")
    ap.add_argument("--layers", type=int, default=32, help="calls chained in one graph")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if build.gpu_backend() != "cuda":
        print("no CUDA device: run this on the GPU machine")
        return 2
    return 0 if bench_old(args.old_dir, args.layers, args.iters) else 1


if __name__ == "__main__":
    sys.exit(main())
