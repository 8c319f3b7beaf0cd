"""The paged kernels on a real GPU (skipped elsewhere: `pytest` on the GPU machine runs them): the
decode kernel (the portable source's CUDA or Metal instantiation, and CUDA's tensor-core variant)
against the gather path on random pools and block tables, with and without a sliding window and
attention sinks, split and unsplit; the in-place page write (reshape_and_cache) against a scatter,
including reads of the pages in the same graph right after the write (the ordering that `written`
provides); and, on CUDA, every kernel setting scripts/bench/bench_attention.py sweeps, which must be
right before it can be timed or made the default. Outputs are poisoned with NaN before each kernel
run, so an element the kernel never writes fails. (On the CPU, tests/test_portable_kernels.py runs the
same sources in an emulator; scripts/bench/bench_old_kernels.py times them against the kernels
before the portable rewrite.)
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from pagedmlx.kernels import build, decode_attention, page_write
from pagedmlx.kernels.dialect import CUDA
from pagedmlx.runner.attention import _gather, gather_decode
from pagedmlx.runner.masks import length_mask

BACKEND = build.gpu_backend()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(BACKEND is None, reason="a GPU (CUDA or Metal) runs the kernels")]
needs_cuda = pytest.mark.skipif(BACKEND != CUDA, reason="CUDA's own settings")
TOL = {mx.float32: 2e-3, mx.float16: 2e-2, mx.bfloat16: 4e-2}
DTYPES = [mx.bfloat16, mx.float16, mx.float32]


def reference(q, k_pages, v_pages, table, seq_lens, scale, window=None, sinks=None):
    """The gather path in float32: gather pages, mask by length (and window), SDPA (GQA native)."""
    f32 = (lambda x: x.astype(mx.float32))
    mask = length_mask(seq_lens, table.shape[1] * k_pages.shape[2], window)
    return gather_decode(f32(q), f32(k_pages), f32(v_pages), table, scale, mask, sinks)


def check_decode_case(*, B, H, n_kv, D, bs, lens, dtype, shared=False, num_blocks=None, seed=0, variant=None,
                      window=None, sinks=False):
    """variant: a kernel setting other than the default, as in bench_attention's sweep. window: attend
    the last `window` keys; sinks: random per-head sink logits. Split as num_splits says, unsplit,
    and in a few splits of at least 64 keys."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(*lens, B) if isinstance(lens, tuple) else np.asarray(lens)
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
    splits, _ = decode_attention.num_splits(B, n_kv, int(max(lens)), window)
    for forced in sorted({splits, 1, min(4, -(-span // 64))}):
        tok = -(-span // forced)
        got = decode_attention.paged_decode(q, k_pages, v_pages, table, seq_lens, scale, -(-span // tok),
                                            mx.array([tok], mx.int32), window=window, sinks=sink,
                                            init_value=float("nan"), settings=variant).astype(mx.float32)
        err = mx.abs(got - want).max().item()
        assert np.isfinite(err) and err <= TOL[dtype] * max(1.0, mx.abs(want).max().item()), (forced, err)


CASES = {  # name: (B, H, n_kv, D, bs, lens: a list, or (low, high) drawn at random), extra
    "llama-8b heads, random lengths": dict(B=16, H=32, n_kv=8, D=128, bs=16, lens=(1, 700)),
    "lengths multiple of block size": dict(B=8, H=32, n_kv=8, D=128, bs=16, lens=[16, 32, 48, 64, 256, 512, 16, 128]),
    "shared prefix blocks": dict(B=12, H=16, n_kv=4, D=64, bs=8, lens=(60, 300), shared=True),
    "one sequence, very long context": dict(B=1, H=32, n_kv=8, D=128, bs=16, lens=[32768 - 5]),
    "MHA (G=1), head_dim 64": dict(B=5, H=8, n_kv=8, D=64, bs=32, lens=[1, 2, 31, 33, 1000]),
    "G=7 (qwen-style), head_dim 128": dict(B=6, H=28, n_kv=4, D=128, bs=16, lens=(1, 2000)),
}
WINDOW_SINK_CASES = {
    "llama-8b heads, window 256": dict(B=16, H=32, n_kv=8, D=128, bs=16, lens=(1, 700), window=256),
    "llama-8b heads, sinks": dict(B=16, H=32, n_kv=8, D=128, bs=16, lens=(1, 700), sinks=True),
    "llama-8b heads, window 256 and sinks": dict(B=16, H=32, n_kv=8, D=128, bs=16, lens=(1, 700), window=256,
                                                 sinks=True),
    "one long sequence, window 4096": dict(B=1, H=32, n_kv=8, D=128, bs=16, lens=[32768 - 5], window=4096, sinks=True),
    "G=7, window 100": dict(B=6, H=28, n_kv=4, D=128, bs=16, lens=(1, 2000), window=100, sinks=True),
    "MHA head_dim 64, window 17 < block": dict(B=5, H=8, n_kv=8, D=64, bs=32, lens=[1, 2, 31, 33, 1000], window=17,
                                               sinks=True),
    "window longer than every sequence": dict(B=4, H=16, n_kv=2, D=256, bs=16, lens=[5, 300, 129, 64], window=100000),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_the_gather_path(name, dtype):
    check_decode_case(**CASES[name], dtype=dtype)


@pytest.mark.parametrize("lanes", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(WINDOW_SINK_CASES))
def test_decode_with_windows_and_sinks_matches_the_gather_path(name, dtype, lanes):
    """With the default settings, and with the lanes kernel (no tensor cores: CUDA's mma=0, Metal's own)."""
    variant = dataclasses.replace(decode_attention.SETTINGS[BACKEND], mma=0) if lanes else None
    check_decode_case(**WINDOW_SINK_CASES[name], dtype=dtype, variant=variant, seed=1)


def bench_attention_variants():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from scripts.bench.bench_attention import VARIANTS, settings

    return [settings(v) for v in VARIANTS]


VARIANT_CASES = [dict(B=16, H=32, n_kv=8, D=128, bs=16, lens=(1, 700)),
                 dict(B=5, H=8, n_kv=4, D=64, bs=32, lens=[1, 2, 31, 33, 1000]),
                 dict(B=3, H=8, n_kv=2, D=256, bs=16, lens=[5, 300, 129]),
                 dict(B=3, H=16, n_kv=2, D=128, bs=16, lens=[7, 250, 16]),
                 dict(B=1, H=28, n_kv=4, D=128, bs=16, lens=[20000 - 3]),
                 dict(B=4, H=8, n_kv=8, D=64, bs=16, lens=[1, 17, 64, 500])]


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_setting_bench_attention_sweeps_matches_the_gather_path(dtype):
    for variant in bench_attention_variants():
        for case in VARIANT_CASES:
            check_decode_case(**case, dtype=dtype, variant=variant)


def check_page_write(*, T, n_kv, D, bs, num_blocks, dtype, seed=0, rounds=8):
    """reshape_and_cache against a numpy scatter; then, in one graph each round, write a new token per
    sequence and read the pages at once through the decode kernel and through the gather path (which
    prefill uses): both must see the new token."""
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
    assert np.array_equal(np.array(k_pages.astype(mx.float32)), want_k), "in-place write differs from a scatter"
    assert np.array_equal(np.array(v_pages.astype(mx.float32)), want_v), "in-place write differs from a scatter"
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
        assert np.isfinite(err) and err <= TOL[dtype] * max(1.0, mx.abs(want).max().item()), (r, err)
        assert all(np.array_equal(np.array(gathered[b, :, lens[b] - 1]), np.array(nk[b, :, 0].astype(mx.float32)))
                   for b in range(B)), f"round {r}: the gather path missed the new token"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [dict(T=300, n_kv=8, D=128, bs=16, num_blocks=256, seed=3),
                                   dict(T=50, n_kv=2, D=64, bs=32, num_blocks=64, seed=4)],
                         ids=["llama-8b kv heads", "head_dim 64, block 32"])
def test_page_write_lands_in_place_and_reads_in_the_same_graph_see_it(shape, dtype):
    check_page_write(**shape, dtype=dtype)
