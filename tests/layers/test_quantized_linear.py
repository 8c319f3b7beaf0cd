"""Quantized models' products over a step's rows (layers/quantized_linear.py): inside the runner's forward every
quantized product, LM head included (tied: the quantized embedding's as_linear), multiplies one (rows, width)
matrix, never a batch of one-row products (MLX's CUDA kernel reads the weights once per batch entry); outside
it the layers run as mlx-lm's own; a busy engine on a quantized model gives each request mlx-lm's tokens alone."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from utils import assert_solo_greedy, make_prompts, run_staggered, solo_greedy

from pagedmlx.bench.presets import Quantization, quantize_model
from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.loaders.random_model import RANDOM_ARCHS, build_model, random_model
from pagedmlx.layers.merged_linear import MergedLinear
from pagedmlx.layers.quantized_linear import FlatQuantizedLinear, flat_rows, flatten_quantized
from pagedmlx.sampling_params import SamplingParams


def _quantized(arch: str, bits: int = 4) -> nn.Module:
    model = random_model(arch, 0)
    quantize_model(model, Quantization(bits, 32))
    return model


def _spy(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the inputs of every mx.quantized_matmul call from now on."""
    shapes = []
    real = mx.quantized_matmul

    def spy(x, *args, **kwargs):
        shapes.append(tuple(x.shape))
        return real(x, *args, **kwargs)
    monkeypatch.setattr(mx, "quantized_matmul", spy)
    return shapes


def test_inside_flat_rows_a_quantized_layer_multiplies_one_matrix(monkeypatch):
    layer = nn.QuantizedLinear(64, 96, bias=True, group_size=32, bits=4)
    x = mx.random.normal((5, 1, 64), key=mx.random.key(1))
    want = layer(x)
    assert flatten_quantized(layer) == 1 and type(layer) is FlatQuantizedLinear
    shapes = _spy(monkeypatch)
    assert mx.array_equal(layer(x), want) and shapes == [(5, 1, 64)]  # outside: nn.QuantizedLinear's own call
    with flat_rows():
        got = layer(x)
    assert shapes[-1] == (5, 64) and got.shape == (5, 1, 96) and mx.array_equal(got, want)
    assert flatten_quantized(layer) == 1  # again: nothing changes


@pytest.mark.parametrize("arch,merge", [("llama-tiny", True), ("llama-tiny", False), ("llama-tiny-tied", True)])
def test_engine_on_a_quantized_model_multiplies_rows_as_one_matrix_and_gives_mlx_lm_tokens(arch, merge, monkeypatch):
    """Busy (decodes of up to 16 requests beside chunked prompts), merged projections or not, an untied quantized
    LM head or a tied quantized embedding's: no quantized product of the engine's steps takes a batch of one-row
    products, and each request's tokens are mlx-lm's generate_step's for its prompt alone."""
    model = _quantized(arch)
    vocab = RANDOM_ARCHS[arch]["vocab_size"]
    prompts = [p[:40] for p in make_prompts(24, vocab, seed=5)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=64,
                                                 long_prefill_token_threshold=32, max_num_seqs=16,
                                                 merge_projections=merge))
    if merge:
        assert isinstance(model.model.layers[0].mlp.gate_proj, MergedLinear)
        assert type(model.model.layers[0].mlp.gate_proj.linear) is FlatQuantizedLinear
    shapes = _spy(monkeypatch)
    done = run_staggered(engine, prompts, params, seed=2)
    assert shapes and all(len(s) == 2 for s in shapes), sorted({s for s in shapes if len(s) != 2})
    assert max(s[0] for s in shapes) > 8  # rows enough for MLX's tiled kernel (it takes 8 rows and more)
    monkeypatch.undo()
    for i, p in enumerate(prompts):
        assert done[str(i)] == solo_greedy(model, p, params.max_tokens), f"request {i}"


def test_mlx_lm_on_the_same_model_object_runs_as_before(monkeypatch):
    """After an engine swapped the layers, mlx-lm's own forward passes the shapes it always did."""
    model = _quantized("llama-tiny", bits=8)
    want = model(mx.array([[1, 2, 3, 4]]))
    LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64, merge_projections=False))
    shapes = _spy(monkeypatch)
    assert mx.array_equal(model(mx.array([[1, 2, 3, 4]])), want)
    assert shapes and all(s[:2] == (1, 4) for s in shapes)


# Every quantization mlx-lm's convert writes: affine at 4 and 8 bits and group sizes 32 / 64 / 128, a mixed
# conversion (8-bit embeddings and head over a 4-bit body), and MLX's microscaled modes (mxfp4 for gpt-oss).
QUANTIZATIONS = {
    "affine4-g32": Quantization(4, 32), "affine4-g64": Quantization(4, 64), "affine4-g128": Quantization(4, 128),
    "affine8-g64": Quantization(8, 64), "mixed-8head-4body": Quantization(4, 64, head_bits=8),
    "mxfp4": Quantization(4, 32, mode="mxfp4"), "mxfp8": Quantization(8, 32, mode="mxfp8"),
    "nvfp4": Quantization(4, 16, mode="nvfp4"),
}
WIDE_LLAMA = dict(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512, rms_norm_eps=1e-5,
                  tie_word_embeddings=False)


@pytest.mark.parametrize("name", list(QUANTIZATIONS))
def test_every_quantization_mlx_lm_writes_gives_mlx_lm_tokens_busy(name):
    """A busy engine (staggered arrivals, shared prefixes, chunked prompts, merged projections) on each
    quantization gives every request mlx-lm's generate_step tokens for its prompt alone."""
    model = build_model(WIDE_LLAMA, seed=3)
    quantize_model(model, QUANTIZATIONS[name])  # as the quantized presets and mlx-lm's convert do
    assert type(model.model.layers[0].mlp.down_proj) is nn.QuantizedLinear
    if QUANTIZATIONS[name].head_bits:
        layers = (model.lm_head, model.model.embed_tokens, model.model.layers[0].mlp.down_proj)
        assert [m.bits for m in layers] == [8, 8, 4]
    prompts = [p[:48] for p in make_prompts(10, WIDE_LLAMA["vocab_size"], seed=7)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=48,
                                                 long_prefill_token_threshold=16, max_num_seqs=8,
                                                 merge_projections=True))
    done = run_staggered(engine, prompts, params, seed=4)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, params.max_tokens, f"{name} request {i}")


@pytest.mark.parametrize("arch", ["gemma4-e-tiny", "gemma4-moe-tiny", "qwen3_5_moe-tiny", "gpt-oss-tiny"])
def test_quantized_families_give_mlx_lm_tokens_busy(arch):
    """The seed's families at 4 bits (Gemma 4 with shared KV and sliding windows, its MoE, Qwen3.6's hybrid MoE
    with recurrent layers; gpt-oss in mxfp4 as it ships): busy equals mlx-lm alone."""
    model = random_model(arch)
    quantize_model(model, Quantization(4, 32, mode="mxfp4" if arch.startswith("gpt-oss") else "affine"))
    vocab = RANDOM_ARCHS[arch].get("vocab_size") or RANDOM_ARCHS[arch]["text_config"]["vocab_size"]
    prompts = [p[:40] for p in make_prompts(8, vocab, seed=11)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=512, max_num_batched_tokens=48,
                                                 long_prefill_token_threshold=16, max_num_seqs=8))
    done = run_staggered(engine, prompts, params, seed=6)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, params.max_tokens, f"{arch} request {i}")
