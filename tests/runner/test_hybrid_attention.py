"""Sliding windows, shared KV and attention sinks on pages: a busy engine gives each request of
Gemma 3 / 3n / 4, gpt-oss, Cohere 2, OLMo 3 and Ministral 3 models exactly what mlx-lm gives that
prompt alone (tiny random-weight float32 models, window 8 over pages of 4 tokens)."""

from __future__ import annotations

import random
from typing import Optional

import pytest
from utils import (assert_no_leaks, assert_samples_equal_alone, assert_solo_greedy, make_model, run_staggered,
                   shared_prefix_prompts, solo_mismatch)

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.core.kv.spec import cdiv
from pagedmlx.runner import attention, attention_metadata
from pagedmlx.runner.plan import UnsupportedModelError
from pagedmlx.sampling_params import SamplingParams

HYBRID = ["gemma3-tiny", "gemma4-e-tiny", "gemma4-moe-tiny", "gemma3n-tiny", "gpt-oss-tiny", "cohere2-tiny",
          "olmo3-tiny", "ministral3-tiny"]
WINDOW, BS = 8, 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompts_across_windows(n: int, seed: int) -> list[list[int]]:
    """Lengths 1..90 (up to 11 windows); a third extend a shared 30-token prefix (hits inside and
    beyond the window), two are 1-token prompts."""
    return shared_prefix_prompts(n, seed, max_len=90)


def busy_engine(model, num_blocks: int = 60, sdpa_quantum: Optional[int] = None) -> LLMEngine:
    """Chunks of up to 40 tokens (longer than attention's padded threshold: both prefill paths run),
    a pool small enough to preempt."""
    config = EngineConfig(block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=64,
                          long_prefill_token_threshold=40, max_num_seqs=12, sdpa_quantum=sdpa_quantum)
    return LLMEngine(model, None, config)


def sliding_blocks_held(engine) -> list[tuple[int, int]]:
    """(pages held in a sliding group, tokens computed) of each running request past its prefill."""
    managers = [m for m in engine.kv_cache_manager.managers if hasattr(m, "sliding_window")]
    held = []
    for req in engine.scheduler.running:
        if req.num_output_tokens >= 2:
            for m in managers:
                blocks = m.req_to_blocks.get(req.request_id, [])
                held.append((sum(b is not m.block_pool.null_block for b in blocks), req.num_computed_tokens))
    return held


@pytest.mark.parametrize("arch", HYBRID)
def test_busy_engine_equals_solo(arch):
    model = make_model(arch)
    engine = busy_engine(model)
    groups = [g.name for g in engine.runner.kv_cache_config.kv_cache_groups]
    assert groups == ["full", f"sliding {WINDOW}"], groups
    prompts = prompts_across_windows(24, seed=5)
    most_held = []
    real_step = engine.step

    def step_and_watch():
        outs = real_step()
        most_held.extend(sliding_blocks_held(engine))
        return outs

    engine.step = step_and_watch
    done = run_staggered(engine, prompts, GREEDY, seed=2)
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache_manager.stats.hits > 0
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, GREEDY.max_tokens, f"request {i} ({len(p)} tokens)")
    # A decoding request holds only its window's pages in the sliding group (and the one being filled).
    limit = cdiv(WINDOW - 1, BS) + 2
    assert most_held and all(n <= limit for n, _ in most_held), max(most_held)
    assert any(c > 3 * WINDOW for _, c in most_held)  # ... however long it has grown
    assert_no_leaks(engine)


@pytest.mark.parametrize("arch", ["gemma3-tiny", "gpt-oss-tiny"])
def test_padded_attention_shapes_keep_windows_and_sinks(arch):
    """CUDA's padding of attention shapes (attention_metadata.sdpa_padding), forced on the CPU with a
    quantum of 12: the window's band mask and the sinks still see only each query's own keys."""
    model = make_model(arch)
    engine = busy_engine(model, sdpa_quantum=12)
    assert engine.runner.sdpa_quantum == 12
    prompts = prompts_across_windows(16, seed=9)
    done = run_staggered(engine, prompts, GREEDY, seed=3)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, GREEDY.max_tokens, f"request {i} ({len(p)} tokens)")
    assert_no_leaks(engine)


def test_sliding_prefix_hits_reuse_only_the_window():
    """A prompt extending an earlier one long past the window hits the cache: the sliding group
    revives only the window's pages before the hit (the rest are the null block) and the tokens
    still equal mlx-lm's."""
    model = make_model("gemma3-tiny")
    engine = busy_engine(model, num_blocks=200)
    base = [random.Random(3).randrange(1, 500) for _ in range(41)]
    engine.add_request("first", base, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    longer = base[:40] + [11, 12, 13]
    engine.add_request("second", longer, GREEDY)
    engine.step()
    req = engine.scheduler.requests["second"]
    assert req.num_cached_tokens == 40
    sliding = engine.kv_cache_manager.managers[1]
    blocks = sliding.req_to_blocks["second"]
    real = [i for i, b in enumerate(blocks) if b is not sliding.block_pool.null_block]
    assert real[0] >= (40 - WINDOW + 1) // BS - 1 and len(real) <= cdiv(WINDOW - 1, BS) + 2
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert_solo_greedy(done["second"], model, longer, GREEDY.max_tokens)
    assert_no_leaks(engine)


@pytest.mark.parametrize("arch", ["gemma3-tiny", "gpt-oss-tiny"])
def test_seeded_samples_and_n_equal_alone(arch):
    """n > 1 seeded samples in a busy engine equal the same samples run alone."""
    model = make_model(arch)
    params = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=8, ignore_eos=True)
    assert_samples_equal_alone(lambda: busy_engine(model, num_blocks=200), prompts_across_windows(8, seed=9), params)


def _mismatches(arch: str) -> int:
    model = make_model(arch)
    prompts = prompts_across_windows(6, seed=1)
    done = run_staggered(busy_engine(model, num_blocks=200), prompts, GREEDY, seed=1)
    return sum(solo_mismatch(done[str(i)], model, p, GREEDY.max_tokens) is not None for i, p in enumerate(prompts))


def test_negative_control_dropping_the_window_gives_other_tokens(monkeypatch):
    assert _mismatches("gemma3-tiny") == 0
    real = attention_metadata.causal_mask
    monkeypatch.setattr(attention_metadata, "causal_mask", lambda k, q, window: real(k, q, None))
    monkeypatch.setattr(attention_metadata, "_window_tables",
                        lambda table, seq_lens, q, bs, window: (table[:, :cdiv(int(seq_lens.max()), bs)], seq_lens))
    with pytest.raises(UnsupportedModelError, match="different logits on pages"):  # the load-time check sees it
        _mismatches("gemma3-tiny")
    monkeypatch.setattr("pagedmlx.runner.model.ModelRunner._verify_against_mlx_lm", lambda self, key=None: None)
    assert _mismatches("gemma3-tiny") > 0


def test_negative_control_dropping_the_sinks_gives_other_tokens(monkeypatch):
    real = attention.PagedLayerCache.attention
    monkeypatch.setattr(attention.PagedLayerCache, "attention", lambda self, q, scale, sinks=None: real(self, q, scale))
    monkeypatch.setattr("pagedmlx.runner.model.ModelRunner._verify_against_mlx_lm", lambda self, key=None: None)
    assert _mismatches("gpt-oss-tiny") > 0


def test_a_window_only_the_mask_knows_is_refused_by_name():
    """mistral3 wrapping a ministral3 text model with sliding layers: mlx-lm gives it plain KVCaches
    and applies the window through the mask alone. Served on pages it went wrong past the window;
    now it is refused, naming the layer and the window."""
    from pagedmlx.loaders.random_model import RANDOM_ARCHS, build_model

    text = dict(RANDOM_ARCHS["ministral3-tiny"])
    model = build_model(dict(model_type="mistral3", text_config=text))
    with pytest.raises(UnsupportedModelError, match=r"'mistral3': layer 0 asks for a sliding window of 8 tokens"):
        LLMEngine(model, None, EngineConfig(block_size=BS, num_blocks=32))


@pytest.mark.parametrize("cfg,reason", [
    (dict(model_type="llama4", text_config=dict(
        model_type="llama4_text", attention_bias=False, hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        intermediate_size_mlp=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
        rms_norm_eps=1e-5, rope_theta=500000.0, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=1, attention_chunk_size=8, use_qk_norm=True, max_position_embeddings=4096,
        attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1, rope_scaling=None,
        no_rope_layers=[1, 1, 1, 0])), "chunked local attention"),
])  # recurrent state (mamba2, ...) is served now: tests/test_state_layers.py
def test_other_cache_kinds_are_refused_by_name(cfg, reason):
    from pagedmlx.loaders.random_model import build_model

    with pytest.raises(UnsupportedModelError, match=f"{cfg['model_type']}.*layer 0 needs {reason}"):
        LLMEngine(build_model(cfg), None, EngineConfig(block_size=BS, num_blocks=32))
