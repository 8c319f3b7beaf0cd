"""The paged kernels (the portable source's CUDA instantiation, and the CUDA-only tensor-core
variant) against MLX ops: paged decode against the gather path on random pools and block tables,
with and without a sliding window and attention sinks, and the in-place page write
(reshape_and_cache) against a scatter, including reads of the pages in the same graph right after
the write (the ordering that `written` provides).

Run on the GPU machine; prints PASS/FAIL per case and exits non-zero on any failure. Outputs are
poisoned with NaN before each kernel run, so an element the kernel never writes fails the case.

  python scripts/gpu/gpu_check_decode.py                      # every case, every bench_attention variant
  python scripts/gpu/gpu_check_decode.py --variants 0 4 --window-sinks
  python scripts/gpu/gpu_check_decode.py --variants --skip-default --bench-old OLD_DIR
      # OLD_DIR: the kernel sources before the portable rewrite, for an old-vs-new timing table:
      # mkdir OLD_DIR && for f in cuda_sources cuda_mma_sources; do
      #   git show 00010ee:pagedmlx/runner/$f.py > OLD_DIR/$f.py; done
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.kernels import build, decode_attention, page_write  # noqa: E402
from pagedmlx.runner.attention import _gather, gather_decode  # noqa: E402
from pagedmlx.runner.attention_metadata import length_mask  # noqa: E402
from scripts.bench.bench_attention import VARIANTS, settings  # noqa: E402

TOL = {mx.float32: 2e-3, mx.float16: 2e-2, mx.bfloat16: 4e-2}


def reference(q, k_pages, v_pages, table, seq_lens, scale, window=None, sinks=None):
    """The gather path in float32: gather pages, mask by length (and window), SDPA (GQA native)."""
    f32 = (lambda x: x.astype(mx.float32))
    mask = length_mask(seq_lens, table.shape[1] * k_pages.shape[2], window)
    return gather_decode(f32(q), f32(k_pages), f32(v_pages), table, scale, mask, sinks)


def case(name, *, B, H, n_kv, D, bs, lens, dtype, shared=False, num_blocks=None, seed=0, variant=None,
         window=None, sinks=False):
    """variant: a kernel setting other than the default, as in bench_attention's sweep.
    window: attend the last `window` keys; sinks: random per-head sink logits."""
    rng = np.random.default_rng(seed)
    nb = max(-(-int(max(lens)) // bs), 1)
    num_blocks = num_blocks or B * nb + 3
    k_pages = mx.array(rng.standard_normal((num_blocks, n_kv, bs, D)).astype(np.float32)).astype(dtype)
    v_pages = mx.array(rng.standard_normal((num_blocks, n_kv, bs, D)).astype(np.float32)).astype(dtype)
    if shared:  # every sequence starts with the same pages, as prefix-cache hits do
        table = np.concatenate([np.tile(rng.permutation(num_blocks)[: nb // 2], (B, 1)),
                                rng.integers(0, num_blocks, (B, nb - nb // 2))], axis=1)
    else:
        table = rng.permutation(num_blocks)[: B * nb].reshape(B, nb) if B * nb <= num_blocks else \
            rng.integers(0, num_blocks, (B, nb))
    table = mx.array(table.astype(np.int32))
    seq_lens = mx.array(np.asarray(lens, np.int32))
    q = mx.array(rng.standard_normal((B, H, D)).astype(np.float32)).astype(dtype)
    scale = D ** -0.5
    sink = mx.array(rng.standard_normal(H).astype(np.float32) * 3) if sinks else None
    want = reference(q, k_pages, v_pages, table, seq_lens, scale, window, sink)
    span = int(min(max(lens), window or max(lens)))
    splits, tokens = decode_attention.num_splits(B, n_kv, int(max(lens)), window)
    results = []
    for forced in sorted({splits, 1, min(4, -(-span // 64))}):
        tok = -(-span // forced)
        got = decode_attention.paged_decode(q, k_pages, v_pages, table, seq_lens, scale, -(-span // tok),
                                         mx.array([tok], mx.int32), window=window, sinks=sink,
                                         init_value=float("nan"), settings=variant).astype(mx.float32)
        err = mx.abs(got - want).max().item()
        ok = np.isfinite(err) and err <= TOL[dtype] * max(1.0, mx.abs(want).max().item())
        results.append(ok)
        extra = (f" window={window}" if window else "") + (" sinks" if sinks else "")
        print(f"{'PASS' if ok else 'FAIL'}  {name:<44} splits={-(-span // tok):<3} max|err|={err:.2e}{extra}"
              + (f" {dataclasses.astuple(variant)[:6]}" if variant else ""))
    return all(results)


def write_case(name, *, T, n_kv, D, bs, num_blocks, dtype, seed=0, rounds=8):
    """reshape_and_cache against a numpy scatter; then, in one graph each round, write a new token
    per sequence and read the pages at once through the decode kernel and through the gather path
    (which prefill uses): both must see the new token."""
    rng = np.random.default_rng(seed)
    k0 = rng.standard_normal((num_blocks, n_kv, bs, D)).astype(np.float32)
    v0 = rng.standard_normal((num_blocks, n_kv, bs, D)).astype(np.float32)
    k_pages, v_pages = mx.array(k0).astype(dtype), mx.array(v0).astype(dtype)
    mx.eval(k_pages, v_pages)
    want_k, want_v = np.array(k_pages.astype(mx.float32)), np.array(v_pages.astype(mx.float32))
    slots = rng.permutation(num_blocks * bs)[:T].astype(np.int32)
    slots[::7] = -1  # skipped rows
    keys = mx.array(rng.standard_normal((T, n_kv, 1, D)).astype(np.float32)).astype(dtype)
    values = mx.array(rng.standard_normal((T, n_kv, 1, D)).astype(np.float32)).astype(dtype)
    mx.eval(page_write.reshape_and_cache(keys, values, k_pages, v_pages, mx.array(slots)))
    for i, s in enumerate(slots):
        if s >= 0:
            want_k[s // bs, :, s % bs] = np.array(keys[i, :, 0].astype(mx.float32))
            want_v[s // bs, :, s % bs] = np.array(values[i, :, 0].astype(mx.float32))
    ok = (np.array_equal(np.array(k_pages.astype(mx.float32)), want_k)
          and np.array_equal(np.array(v_pages.astype(mx.float32)), want_v))
    print(f"{'PASS' if ok else 'FAIL'}  {name:<44} in-place write equals scatter ({T} rows)")
    # Write then read in one graph, several rounds (a missing dependency shows up as a race).
    B = 8
    nb = num_blocks // B
    table = mx.array(rng.permutation(num_blocks)[: B * nb].reshape(B, nb).astype(np.int32))
    H = n_kv * 4
    scale = D ** -0.5
    for r in range(rounds):
        lens = rng.integers(1, nb * bs + 1, B).astype(np.int32)
        new_slots = np.array([int(table[b, (lens[b] - 1) // bs].item()) * bs + (lens[b] - 1) % bs for b in range(B)],
                             np.int32)
        nk = mx.array(rng.standard_normal((B, n_kv, 1, D)).astype(np.float32) * 3).astype(dtype)
        nv = mx.array(rng.standard_normal((B, n_kv, 1, D)).astype(np.float32) * 3).astype(dtype)
        q = mx.array(rng.standard_normal((B, H, D)).astype(np.float32)).astype(dtype)
        seq_lens = mx.array(lens)
        written = page_write.reshape_and_cache(nk, nv, k_pages, v_pages, mx.array(new_slots))
        splits, tokens = decode_attention.num_splits(B, n_kv, int(lens.max()))
        got = decode_attention.paged_decode(q, k_pages, v_pages, table, seq_lens, scale, splits,
                                         mx.array([tokens], mx.int32), written, init_value=float("nan"))
        gathered = _gather(k_pages, table + written)
        got, gathered = got.astype(mx.float32), gathered.astype(mx.float32)
        mx.eval(got, gathered)
        want = reference(q, k_pages, v_pages, table, seq_lens, scale)
        err = mx.abs(got - want).max().item()
        seen = all(np.array_equal(np.array(gathered[b, :, lens[b] - 1]), np.array(nk[b, :, 0].astype(mx.float32)))
                   for b in range(B))
        good = np.isfinite(err) and err <= TOL[dtype] * max(1.0, mx.abs(want).max().item()) and seen
        ok &= good
        if not good:
            print(f"FAIL  {name:<44} round {r}: decode max|err|={err:.2e}, gather saw the new token: {seen}")
    print(f"{'PASS' if ok else 'FAIL'}  {name:<44} write then read in one graph, {rounds} rounds")
    return ok


def window_sink_cases(rng, variant=None, tag="") -> bool:
    """Sliding windows (shorter than a block, across blocks and splits, longer than every sequence)
    and sinks, alone and together, per dtype."""
    ok = True
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        dn = str(dtype).split(".")[-1] + tag
        for window, sinks in [(256, False), (None, True), (256, True)]:
            ok &= case(f"{dn} llama-8b heads, random lengths", B=16, H=32, n_kv=8, D=128, bs=16,
                       lens=rng.integers(1, 700, 16), dtype=dtype, window=window, sinks=sinks, variant=variant)
        ok &= case(f"{dn} one long sequence, window 4096", B=1, H=32, n_kv=8, D=128, bs=16, lens=[32768 - 5],
                   dtype=dtype, window=4096, sinks=True, variant=variant)
        ok &= case(f"{dn} G=7, window 100", B=6, H=28, n_kv=4, D=128, bs=16, lens=rng.integers(1, 2000, 6),
                   dtype=dtype, window=100, sinks=True, variant=variant)
        ok &= case(f"{dn} MHA head_dim 64, window 17 < block", B=5, H=8, n_kv=8, D=64, bs=32,
                   lens=[1, 2, 31, 33, 1000], dtype=dtype, window=17, sinks=True, variant=variant)
        ok &= case(f"{dn} window longer than every sequence", B=4, H=16, n_kv=2, D=256, bs=16,
                   lens=[5, 300, 129, 64], dtype=dtype, window=100000, variant=variant)
    return ok


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
    from scripts.bench.timing import timed_chain

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
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--variants", type=int, nargs="*", help="indices into bench_attention.VARIANTS (default: all)")
    ap.add_argument("--skip-default", action="store_true", help="only the variants, not the default settings' cases")
    ap.add_argument("--window-sinks", action="store_true",
                    help="also windows and sinks, with the default settings and the lanes kernel (mma=0)")
    ap.add_argument("--bench-old", metavar="OLD_DIR", help="time the kernels before the rewrite against the new")
    args = ap.parse_args()
    if build.gpu_backend() is None:
        print("SKIP: no GPU backend")
        return 0
    rng = np.random.default_rng(1)
    ok = True
    if args.window_sinks:
        ok &= window_sink_cases(rng)
        ok &= window_sink_cases(rng, dataclasses.replace(decode_attention.SETTINGS["cuda"], mma=0), " lanes")
    for dtype in () if args.skip_default else (mx.bfloat16, mx.float16, mx.float32):
        dn = str(dtype).split(".")[-1]
        ok &= case(f"{dn} llama-8b heads, random lengths", B=16, H=32, n_kv=8, D=128, bs=16,
                   lens=rng.integers(1, 700, 16), dtype=dtype)
        ok &= case(f"{dn} lengths multiple of block size", B=8, H=32, n_kv=8, D=128, bs=16,
                   lens=[16, 32, 48, 64, 256, 512, 16, 128], dtype=dtype)
        ok &= case(f"{dn} shared prefix blocks", B=12, H=16, n_kv=4, D=64, bs=8,
                   lens=rng.integers(60, 300, 12), dtype=dtype, shared=True)
        ok &= case(f"{dn} one sequence, very long context", B=1, H=32, n_kv=8, D=128, bs=16,
                   lens=[32768 - 5], dtype=dtype)
        ok &= case(f"{dn} MHA (G=1), head_dim 64", B=5, H=8, n_kv=8, D=64, bs=32,
                   lens=[1, 2, 31, 33, 1000], dtype=dtype)
        ok &= case(f"{dn} G=7 (qwen-style), head_dim 128", B=6, H=28, n_kv=4, D=128, bs=16,
                   lens=rng.integers(1, 2000, 6), dtype=dtype)
        ok &= write_case(f"{dn} page write, llama-8b kv heads", T=300, n_kv=8, D=128, bs=16, num_blocks=256,
                         dtype=dtype, seed=3)
        ok &= write_case(f"{dn} page write, head_dim 64, block 32", T=50, n_kv=2, D=64, bs=32, num_blocks=64,
                         dtype=dtype, seed=4)
    # The settings bench_attention sweeps must be right before they can be timed or made the default.
    for i, variant in enumerate(VARIANTS):
        if args.variants is not None and i not in args.variants:
            continue
        v = settings(variant)
        for dtype in (mx.bfloat16, mx.float16, mx.float32):
            dn = str(dtype).split(".")[-1]
            ok &= case(f"{dn} llama-8b heads, variant", B=16, H=32, n_kv=8, D=128, bs=16,
                       lens=rng.integers(1, 700, 16), dtype=dtype, variant=v)
            ok &= case(f"{dn} G=2, head_dim 64, variant", B=5, H=8, n_kv=4, D=64, bs=32,
                       lens=[1, 2, 31, 33, 1000], dtype=dtype, variant=v)
            ok &= case(f"{dn} G=4, head_dim 256, variant", B=3, H=8, n_kv=2, D=256, bs=16,
                       lens=[5, 300, 129], dtype=dtype, variant=v)
            ok &= case(f"{dn} G=8, head_dim 128, variant", B=3, H=16, n_kv=2, D=128, bs=16,
                       lens=[7, 250, 16], dtype=dtype, variant=v)
            ok &= case(f"{dn} G=7, one long sequence, variant", B=1, H=28, n_kv=4, D=128, bs=16,
                       lens=[20000 - 3], dtype=dtype, variant=v)
            ok &= case(f"{dn} MHA, head_dim 64, variant", B=4, H=8, n_kv=8, D=64, bs=16,
                       lens=[1, 17, 64, 500], dtype=dtype, variant=v)
    if args.bench_old:
        ok &= bench_old(args.bench_old)
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
