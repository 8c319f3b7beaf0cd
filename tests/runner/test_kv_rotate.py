"""kv_cache_rotate: quantized pages of Hadamard-rotated keys and values (runner/kv_quant.py). Attention
is unchanged up to rounding (q' . k' = q . k, the output rotated back), a key with an outlier channel
loses much less to 4-bit groups, and a busy engine on rotated int4 / int8 pages gives each request the
tokens of mlx-lm's QuantizedKVCache fed the same rotated keys and values, alone."""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
import pytest
from test_kv_quant import BITS, GREEDY
from utils import ARCHS, assert_no_leaks, make_model, make_prompts, run_staggered

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.core.kv.cache_dtype import KVQuant
from pagedmlx.loaders.random_model import RANDOM_ARCHS, build_model
from pagedmlx.runner.kv_quant import _hadamard, rotate_kv, rotate_queries


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_the_rotation_keeps_attention(d):
    """H H = d I exactly; q' . k' = q . k and values come back, to float32 rounding; every matrix entry is
    +-2^-n (exact in 16-bit floats too)."""
    h = np.array(_hadamard(d, 1.0, mx.float32))
    assert (h @ h == d * np.eye(d)).all()
    for m in (rotate_kv(mx.ones((1, d))), rotate_queries(mx.ones((1, d)))):
        assert m.dtype == mx.float32
    assert np.unique(np.abs(np.array(_hadamard(d, 2.0 ** -3, mx.bfloat16).astype(mx.float32)))).tolist() == [0.125]
    rng = np.random.default_rng(d)
    q, k, v = (mx.array(rng.standard_normal((5, d)).astype(np.float32)) for _ in range(3))
    np.testing.assert_allclose(np.array(rotate_queries(q) @ rotate_kv(k).T), np.array(q @ k.T), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.array(rotate_queries(rotate_kv(v))), np.array(v), rtol=1e-5, atol=1e-5)


def test_an_outlier_channel_costs_int4_groups_less_rotated():
    """Keys whose channel 3 is 30x the others (as real models' keys have): int4 in one group of 64 loses
    most of the other channels; rotated first, the error is several times smaller."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((256, 64)).astype(np.float32)
    k[:, 3] *= 30
    k = mx.array(k)

    def error(x, back):
        w, s, b = mx.quantize(x, group_size=64, bits=4)
        return float(mx.mean(mx.square(back(mx.dequantize(w, s, b, group_size=64, bits=4)) - k)))

    plain = error(k, lambda x: x)
    rotated = error(rotate_kv(k), rotate_queries)  # rotate_queries(rotate_kv(x)) == x
    assert rotated < plain / 4, (rotated, plain)


def mlx_lm_rotated_greedy(model, prompt: list[int], max_tokens: int, bits: int, group_size: int,
                          monkeypatch) -> list[int]:
    """mlx-lm alone on QuantizedKVCache, fed rotated keys and values, its quantized attention taking
    rotated queries and giving its output back rotated."""
    import mlx_lm.models.base as base
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache

    class Rotated(QuantizedKVCache):
        def update_and_fetch(self, keys, values):
            return super().update_and_fetch(rotate_kv(keys), rotate_kv(values))

    plain = base.quantized_scaled_dot_product_attention

    def rotated(queries, q_keys, q_values, scale, mask, group_size=64, bits=8):
        return rotate_queries(plain(rotate_queries(queries), q_keys, q_values, scale=scale, mask=mask,
                                    group_size=group_size, bits=bits))

    with monkeypatch.context() as m:
        m.setattr(base, "quantized_scaled_dot_product_attention", rotated)
        cache = [Rotated(group_size, bits) for _ in model.layers]
        steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache)
        return [int(tok) for (tok, _), _ in zip(steps, range(max_tokens))]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_busy_rotated_pages_equal_mlx_lm_on_rotated_keys(kv_cache_dtype, monkeypatch):
    """Staggered arrivals, chunked prefill, preemption and prefix hits on rotated pages: every request's
    greedy tokens equal mlx-lm's, its quantized cache holding the same rotated keys and values."""
    model = make_model("qwen3")  # head_dim 32
    prompts = make_prompts(20, ARCHS["qwen3"]["vocab_size"], seed=9)
    engine = LLMEngine(model, None, EngineConfig(
        block_size=4, num_blocks=120, max_num_batched_tokens=96, long_prefill_token_threshold=48, max_num_seqs=16,
        kv_cache_dtype=kv_cache_dtype, kv_cache_rotate=True))
    assert engine.runner.kv_pool.quant[0] == KVQuant(BITS[kv_cache_dtype], 32, rotate=True)
    assert engine.runner.kv_cache_config.kv_cache_groups[0].kv_cache_dtype == f"{kv_cache_dtype} rotated"  # reports
    done = run_staggered(engine, prompts, GREEDY, seed=4)
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache_manager.stats.hits > 0
    for i, p in enumerate(prompts):
        want = mlx_lm_rotated_greedy(model, p, GREEDY.max_tokens, BITS[kv_cache_dtype], 32, monkeypatch)
        assert done[str(i)] == want, f"request {i} (prompt {len(p)} tokens)"
    assert_no_leaks(engine)


def test_rotation_refusals_and_flag():
    from pagedmlx.engine.arg_utils import add_engine_args, engine_config

    with pytest.raises(ValueError, match="kv_cache_rotate applies to quantized pages only"):
        EngineConfig(kv_cache_rotate=True)
    with pytest.raises(ValueError, match="kv_cache_rotate must be true or false, got 'yes'"):
        EngineConfig(kv_cache_dtype="int4", kv_cache_rotate="yes")
    cfg = dict(RANDOM_ARCHS["qwen3-tiny"], head_dim=96)  # groups of 32 divide it, no Hadamard matrix has 96 rows
    with pytest.raises(ValueError, match="head dims 96/96 are not both powers of two"):
        LLMEngine(build_model(cfg, seed=0), None, EngineConfig(num_blocks=16, kv_cache_dtype="int8",
                                                                kv_cache_rotate=True))
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config(p.parse_args(["--kv-cache-dtype", "int4", "--kv-cache-rotate"]))
    assert cfg.kv_cache_rotate and not engine_config(p.parse_args([])).kv_cache_rotate


@pytest.mark.skipif(not __import__("kernel_emulator").have_compiler(), reason="g++ runs the emulated kernels")
def test_the_quantized_decode_kernel_reads_rotated_pages(monkeypatch):
    """On emulated Metal the quantized decode kernel serves the decode rows of rotated int8 pages (it reads
    them as any pages; the queries come rotated, the output goes back): mlx-lm's tokens on rotated keys."""
    from kernel_emulator import EmulatedKernel
    from utils import run_to_completion

    from pagedmlx.kernels import build, decode_attention, decode_attention_quant
    from pagedmlx.kernels.dialect import METAL
    from pagedmlx.sampling_params import SamplingParams

    monkeypatch.setattr(build, "gpu_backend", lambda: METAL)
    monkeypatch.delenv("PAGEDMLX_METAL_KERNELS", raising=False)
    monkeypatch.setattr(build, "make_kernel", lambda *a: EmulatedKernel(*a))
    caches = (decode_attention_quant._kernels, decode_attention._kernels, decode_attention.supports)
    for f in caches:
        f.cache_clear()
    try:
        model = make_model("qwen3")
        engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64, max_model_len=256,
                                                     kv_cache_dtype="int8", kv_cache_rotate=True))
        assert engine.runner.kernels.decode
        prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], list(range(11, 30))]
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        before = len(EmulatedKernel.sources)
        done = run_to_completion(engine)
        assert len(EmulatedKernel.sources) > before  # decode rows ran the kernel
        for i, p in enumerate(prompts):
            assert done[str(i)].token_ids == mlx_lm_rotated_greedy(model, p, 6, 8, 32, monkeypatch), i
    finally:
        for f in caches:
            f.cache_clear()
