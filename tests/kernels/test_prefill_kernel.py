"""The paged prefill kernel (CUDA): its host side on the CPU, and on a CUDA GPU the kernel itself
against the reference. Its source compiled by nvcc: tests/test_cuda_sources.py; its tensor-core
fragment addressing emulated: tests/test_mma_fragments.py.
Here `emulate` runs the kernel's tile and split logic (which keys a tile's split reads, through
which page, under which mask; the merge) in numpy from the very arrays the engine uploads, so the
engine's tiles are checked against the reference, and a busy engine whose prefill rows go through
the emulation must give each request mlx-lm's tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from utils import assert_no_leaks, assert_solo_greedy, make_model, make_prompts, run_staggered, shared_prefix_prompts

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.kernels import build, prefill_attention
from pagedmlx.kernels.dialect import CUDA
from pagedmlx.runner.prefill_indices import Segment, prefill_tile_indices
from pagedmlx.kernels.check import check_prefill, prefill_reference, random_segments
from pagedmlx.runner.model import ModelRunner
from pagedmlx.sampling_params import SamplingParams

TILE = prefill_attention.PREFILL_TILE
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def emulate(q, k_pages, v_pages, table, segs, tiles, scale, splits, split_tokens, window=None, sinks=None,
            coverage=None):
    """What sources/prefill_attention_cuda.py computes, tile by tile and split by split, then merged (float32)."""
    Tp, H, D = q.shape
    n_kv, bs = k_pages.shape[1], k_pages.shape[2]
    G = H // n_kv
    acc = np.zeros((splits, Tp, H, v_pages.shape[-1]), np.float32)
    m = np.full((splits, Tp, H), -np.inf, np.float32)
    l_ = np.zeros((splits, Tp, H), np.float32)
    for seg, tok0 in tiles:
        q_row, n, first_pos, key_offset = segs[seg]
        lo = key_offset if not window else max(key_offset, first_pos + tok0 - window + 1)
        hi = first_pos + min(n, tok0 + TILE)
        toks = np.arange(tok0, min(n, tok0 + TILE))
        pos = first_pos + toks
        rows = q_row + toks
        if coverage is not None:
            coverage[rows] += 1
        for s in range(splits):
            start = lo + s * split_tokens
            keys = np.arange(start, min(hi, start + split_tokens))
            if not len(keys):
                continue
            pages = table[seg][(keys - key_offset) // bs]
            k = k_pages[pages, :, keys % bs].repeat(G, axis=1)  # (K, H, D)
            v = v_pages[pages, :, keys % bs].repeat(G, axis=1)
            see = keys[None, :] <= pos[:, None]
            if window:
                see &= keys[None, :] > pos[:, None] - window
            sc = np.where(see[:, None, :], np.einsum("qhd,khd->qhk", q[rows], k) * scale, -np.inf)
            mm = sc.max(-1)
            p = np.where(np.isfinite(mm)[..., None], np.exp(sc - np.where(np.isfinite(mm), mm, 0)[..., None]), 0)
            m[s, rows], l_[s, rows] = mm, p.sum(-1)
            acc[s, rows] = np.einsum("qhk,khd->qhd", p, v)
    M = m.max(0)
    if sinks is not None:
        M = np.maximum(M, sinks[None, :])
    c = np.where(np.isfinite(m), np.exp(m - M[None]), 0)
    L = (l_ * c).sum(0) + (np.exp(sinks[None, :] - M) if sinks is not None else 0)
    return (acc * c[..., None]).sum(0) / L[..., None]


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(0, 70), st.integers(1, 60)), min_size=1, max_size=5),
       window=st.sampled_from([None, 5, 16, 33]), group=st.sampled_from([1, 3]), forced=st.sampled_from([None, 2, 5]),
       sinks=st.booleans(), seed=st.integers(0, 2**16))
def test_tiles_cover_each_query_once_and_give_the_reference(shapes, window, group, forced, sinks, seed):
    """Any mix of prefixes, chunk lengths (tile and page boundaries anywhere), windows, GQA groups
    and splits: each query row lies in exactly one tile, and the tiles' key ranges and splits give
    the reference's attention."""
    rng = np.random.default_rng(seed)
    bs, n_kv, D = 4, 2, 8
    H = n_kv * group
    segments, Tp, num_blocks = random_segments(rng, shapes, bs, window)
    k = rng.standard_normal((num_blocks, n_kv, bs, D)).astype(np.float32)
    v = rng.standard_normal((num_blocks, n_kv, bs, D)).astype(np.float32)
    q = rng.standard_normal((Tp, H, D)).astype(np.float32)
    sink = rng.standard_normal(H).astype(np.float32) if sinks else None
    host, splits = prefill_tile_indices(segments, 0, window, n_kv, group)
    tokens = int(host["prefill_split_tokens"][0])
    if forced:  # more splits than the policy chooses: boundaries inside tiles' ranges, empty splits
        tokens, splits = -(-splits * tokens // forced), forced
    coverage = np.zeros(Tp, np.int32)
    got = emulate(q, k, v, host["prefill_block_table"], host["prefill_segs"], host["prefill_tiles"], 0.5, splits,
                  tokens, window, sink, coverage)
    assert (coverage == 1).all()
    np.testing.assert_allclose(got, prefill_reference(q, k, v, segments, 0.5, window, sink), atol=2e-5, rtol=1e-4)


def test_tiles_run_longest_first_and_split_only_when_the_gpu_would_idle():
    segments = [Segment(0, 64, 0, 0, 64, np.arange(16, dtype=np.int32)),
                Segment(64, 32, 4096, 0, 4128, np.arange(1032, dtype=np.int32))]
    host, splits = prefill_tile_indices(segments, 0, None, 8, 4)
    keys = [segments[s].first_pos + min(segments[s].n, t + TILE) for s, t in host["prefill_tiles"]]
    assert keys == sorted(keys, reverse=True) and len(keys) == 4 + 2
    # 6 tiles x 8 KV heads x 4 warps leave the GPU idle: the 4,128 keys are split, 1,024 or more each.
    assert splits > 1 and splits * host["prefill_split_tokens"][0] >= 4128
    assert host["prefill_split_tokens"][0] >= prefill_attention.PREFILL_MIN_SPLIT
    assert prefill_attention.prefill_splits(600, 8, 4, 32768) == (1, 32768)  # enough tiles: one pass


def test_prefill_kernel_takes_16_bit_layers_it_is_built_for():
    assert prefill_attention.supports_prefill(128, 128, 32, 8, mx.bfloat16)
    assert prefill_attention.supports_prefill(64, 64, 14, 2, mx.float16)
    assert not prefill_attention.supports_prefill(128, 128, 32, 8, mx.float32)  # tensor cores: 16-bit only
    assert not prefill_attention.supports_prefill(256, 256, 8, 4, mx.bfloat16)
    assert not prefill_attention.supports_prefill(128, 64, 8, 4, mx.bfloat16)
    assert not prefill_attention.supports_prefill(128, 128, 32, 2, mx.bfloat16)  # 16 heads per KV head


def _emulated_kernel(monkeypatch, seen):
    """Route prefill rows through `emulate` on the CPU, as the runner routes them to the kernel."""
    def heads(self):
        return [(n_kv, h // n_kv) for n_kv, h in
                ((self.plan[g.layer_ids[0]].spec[0], self.plan[g.layer_ids[0]].n_heads)
                 for g in self.kv_cache_config.kv_cache_groups if not g.is_state)]

    def fake(q, k_pages, v_pages, table, segs, tiles, scale, splits, split_tokens, written=None, window=None,
             sinks=None, init_value=None):
        seen.append((int(tiles.shape[0]), splits, window))
        f = (lambda a: np.array(a.astype(mx.float32)))
        out = emulate(f(q), f(k_pages), f(v_pages), np.array(table), np.array(segs), np.array(tiles), scale, splits,
                      int(split_tokens[0].item()), window, None if sinks is None else f(sinks))
        return mx.array(out).astype(k_pages.dtype)

    monkeypatch.setattr(ModelRunner, "prefill_heads", property(heads))
    monkeypatch.setattr(prefill_attention, "paged_prefill", fake)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3-tiny", "gpt-oss-tiny", "gemma3n-tiny"])
def test_busy_engine_through_the_prefill_kernels_tiles_equals_solo(arch, monkeypatch):
    """The engine's own tiles (chunks beside decodes, prefix hits, preemption; windows, sinks and
    shared layers in the hybrid models) run through the emulation: every request gets mlx-lm's tokens."""
    seen = []
    _emulated_kernel(monkeypatch, seen)
    model = make_model(arch)
    prompts = (shared_prefix_prompts(16, seed=4, max_len=90) if "tiny" in arch
               else make_prompts(16, model.args.vocab_size, seed=4))
    config = EngineConfig(block_size=4, num_blocks=110, max_num_batched_tokens=64, long_prefill_token_threshold=40,
                          max_num_seqs=10)
    engine = LLMEngine(model, None, config)
    done = run_staggered(engine, prompts, GREEDY, seed=2)
    assert seen and any(n > 1 for n, _, _ in seen)  # several tiles a call
    assert engine.kv_cache_manager.stats.hits > 0
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, GREEDY.max_tokens, f"request {i} ({len(p)} tokens)")
    assert_no_leaks(engine)


needs_cuda = pytest.mark.skipif(build.gpu_backend() != CUDA, reason="a CUDA GPU runs the kernel")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("h,n_kv,d,dtype", [(32, 8, 128, mx.bfloat16), (14, 2, 64, mx.float16),
                                            (8, 8, 128, mx.bfloat16), (24, 8, 128, mx.float16)])
@pytest.mark.parametrize("window,sinks", [(None, False), (24, True), (None, True)])
def test_the_kernel_on_the_gpu_matches_the_reference(h, n_kv, d, dtype, window, sinks):
    assert check_prefill(h, n_kv, d, dtype, 16, window, sinks) is None


@pytest.mark.parametrize("arch,kinds", [("llama", [(None, False)]), ("gpt-oss-tiny", [(None, True), (8, True)])])
def test_start_up_compiles_each_kernel_variant_the_layers_run(arch, kinds, monkeypatch):
    """Each (head shape, window, sinks) the layers use, unsplit and split, through both kernels:
    MLX compiles a variant when first run (2-3 s on the H200), which is then not a request's wait."""
    from pagedmlx.kernels import decode_attention
    from pagedmlx.kernels.selector import KernelPlan

    calls = []
    record = (lambda kind: lambda q, *a, window=None, sinks=None, **k: calls.append(
        (kind, a[5] if kind == "decode" else a[6], window, sinks is not None)) or mx.zeros(q.shape))
    monkeypatch.setattr(decode_attention, "paged_decode", record("decode"))
    monkeypatch.setattr(prefill_attention, "paged_prefill", record("prefill"))
    monkeypatch.setattr(decode_attention, "supports_layer", lambda *a: True)
    monkeypatch.setattr(prefill_attention, "supports_prefill", lambda *a: True)
    engine = LLMEngine(make_model(arch), None, EngineConfig(block_size=4, num_blocks=40), verify_model=False)
    engine.runner.kernels = KernelPlan("cuda", decode=True, prefill=True)
    assert engine.runner.compile_kernels() == 4 * len(kinds)
    assert sorted(calls, key=str) == sorted([(kind, splits, w, s) for kind in ("decode", "prefill")
                                             for splits in (1, 2) for w, s in kinds], key=str)


def test_shapes_are_built_at_start_up_only_where_sdpa_takes_the_chunks_beside_decodes(monkeypatch):
    model = make_model("llama")
    built = []
    monkeypatch.setattr(ModelRunner, "warm_up_attention", lambda self, chunk, max_keys: built.append(chunk) or 0)
    monkeypatch.setattr(ModelRunner, "prefill_heads", property(lambda self: [(2, 2)]))
    for chunk in (prefill_attention.PREFILL_KERNEL_MAX_QUERY, prefill_attention.PREFILL_KERNEL_MAX_QUERY + 1):
        engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=40, sdpa_quantum=12,
                                                     long_prefill_token_threshold=chunk), verify_model=False)
        engine.warm_up()
    assert built == [prefill_attention.PREFILL_KERNEL_MAX_QUERY + 1]  # the kernel takes capped chunks: nothing to build



def test_start_up_also_builds_the_gathers_of_quantized_pages(monkeypatch):
    """Quantized pages: a chunk longer than the prefill kernel takes gathers and dequantizes the pages, which
    MLX builds on first use (seconds inside the first long prompts); start-up runs them once on page 0."""
    from pagedmlx.kernels.selector import KernelPlan
    from pagedmlx.runner.kv_quant import QuantizedPages

    gathered = []
    real = QuantizedPages.gather_rows
    monkeypatch.setattr(QuantizedPages, "gather_rows", lambda self, rows, nb: gathered.append(
        (self.quant.bits, rows.shape, nb)) or real(self, rows, nb))
    monkeypatch.setattr(prefill_attention, "paged_prefill", lambda q, *a, **k: mx.zeros(q.shape))
    monkeypatch.setattr(prefill_attention, "supports_prefill", lambda *a: True)
    engine = LLMEngine(make_model("qwen3"), None, EngineConfig(block_size=4, num_blocks=40, kv_cache_dtype="int8"),
                       verify_model=False)
    engine.runner.kernels = KernelPlan("cuda", prefill=True)  # (the decode kernels have a start-up test of their own)
    engine.runner.compile_kernels()
    n_kv = engine.runner.plan[0].spec[0]
    assert gathered == [(8, (1, n_kv, 1), 1)] * 2  # keys and values of the one kind of layer
