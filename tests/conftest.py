"""Shared fixtures: small random-weight float32 models of several mlx-lm architectures."""

from __future__ import annotations

import functools

import mlx.core as mx
import pytest

ARCHS = {
    "llama": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                  tie_word_embeddings=False),
    "llama_tied": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                       num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=384,
                       tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                  vocab_size=448, rope_theta=1_000_000.0, max_position_embeddings=4096,
                  tie_word_embeddings=True),
}


@functools.lru_cache(maxsize=None)
def make_model(arch: str, seed: int = 0):
    import importlib

    cfg = ARCHS[arch]
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    # Larger-than-default weights make logits decisive, so greedy ties are not a matter of rounding.
    model.update(__import__("mlx.utils", fromlist=["tree_map"]).tree_map(lambda p: p * 2.0, model.parameters()))
    mx.eval(model.parameters())
    return model


def solo_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own generation for one prompt alone: the reference every engine output must equal."""
    from mlx_lm.generate import generate_step

    out = []
    for (tok, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=max_tokens), range(max_tokens)):
        out.append(int(tok))
    return out


def assert_no_leaks(engine) -> None:
    pool = engine.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks), [b for b in pool.blocks if b.ref_cnt]
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert not engine.kv_cache_manager.req_to_blocks


@pytest.fixture(params=list(ARCHS))
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def smollm():
    """The real default model, SmolLM2-135M-Instruct (float32 on the CPU), fetched once and cached."""
    from pagedmlx.loader import load_model

    return load_model(None)
