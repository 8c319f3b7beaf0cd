"""The CUDA kernels against MLX ops: paged decode against the gather path on random pools and
block tables, and the in-place page write (reshape_and_cache) against a scatter, including reads
of the pages in the same graph right after the write (the ordering that `written` provides).

Run on the GPU machine; prints PASS/FAIL per case and exits non-zero on any failure. Outputs are
poisoned with NaN before each kernel run, so an element the kernel never writes fails the case.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedmlx.runner import cuda_decode  # noqa: E402
from pagedmlx.runner.attention import _gather  # noqa: E402
from scripts.bench_attention import SETTINGS, VARIANTS  # noqa: E402

TOL = {mx.float32: 2e-3, mx.float16: 2e-2, mx.bfloat16: 4e-2}


def reference(q, k_pages, v_pages, table, seq_lens, scale):
    """The gather path in float32: gather pages, mask by length, SDPA (GQA native)."""
    k = _gather(k_pages.astype(mx.float32), table)
    v = _gather(v_pages.astype(mx.float32), table)
    S = k.shape[2]
    mask = (mx.arange(S)[None, :] < seq_lens[:, None])[:, None, None, :]
    o = mx.fast.scaled_dot_product_attention(q.astype(mx.float32)[:, :, None, :], k, v, scale=scale, mask=mask)
    return o[:, :, 0, :]


def case(name, *, B, H, n_kv, D, bs, lens, dtype, shared=False, num_blocks=None, seed=0, variant=None):
    """variant: a kernel setting other than the default, as in bench_attention's sweep."""
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
    want = reference(q, k_pages, v_pages, table, seq_lens, scale)
    splits, tokens = cuda_decode.num_splits(B, n_kv, int(max(lens)))
    results = []
    for forced in sorted({splits, 1, min(4, -(-int(max(lens)) // 64))}):
        tok = -(-int(max(lens)) // forced)
        got = cuda_decode.paged_decode(q, k_pages, v_pages, table, seq_lens, scale, -(-int(max(lens)) // tok),
                                       mx.array([tok], mx.int32), init_value=float("nan"),
                                       **(variant or {})).astype(mx.float32)
        err = mx.abs(got - want).max().item()
        ok = np.isfinite(err) and err <= TOL[dtype] * max(1.0, mx.abs(want).max().item())
        results.append(ok)
        print(f"{'PASS' if ok else 'FAIL'}  {name:<44} splits={-(-int(max(lens)) // tok):<3} max|err|={err:.2e}"
              + (f" {variant}" if variant else ""))
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
    mx.eval(cuda_decode.reshape_and_cache(keys, values, k_pages, v_pages, mx.array(slots)))
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
        written = cuda_decode.reshape_and_cache(nk, nv, k_pages, v_pages, mx.array(new_slots))
        splits, tokens = cuda_decode.num_splits(B, n_kv, int(lens.max()))
        got = cuda_decode.paged_decode(q, k_pages, v_pages, table, seq_lens, scale, splits,
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--variants", type=int, nargs="*", help="indices into bench_attention.VARIANTS (default: all)")
    ap.add_argument("--skip-default", action="store_true", help="only the variants, not the default settings' cases")
    args = ap.parse_args()
    if not cuda_decode.is_available():
        print("SKIP: no CUDA device")
        return 0
    rng = np.random.default_rng(1)
    ok = True
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
        v = dict(zip(SETTINGS, variant))
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
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
