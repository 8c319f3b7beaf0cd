"""Shared fixtures: small random-weight float32 models of several mlx-lm architectures."""

from __future__ import annotations

import functools

import mlx.core as mx
import pytest

from pagedmlx.models.random_model import RANDOM_ARCHS, random_model, tiny_tokenizer

# The tests' names for the package's random-weight architectures (pagedmlx/models/random_model.py).
_TEST_ARCHS = {"llama": "llama-tiny", "llama_tied": "llama-tiny-tied", "qwen3": "qwen3-tiny"}
ARCHS = {name: RANDOM_ARCHS[arch] for name, arch in _TEST_ARCHS.items()}


@functools.lru_cache(maxsize=None)
def make_model(arch: str, seed: int = 0):
    return random_model(_TEST_ARCHS[arch], seed)


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


make_tokenizer = tiny_tokenizer  # a tiny real HF tokenizer padded to vocab_size (cached)
