"""Merged q/k/v and gate/up projections (layers/merged_linear.py): inside the runner's forward the merged
model computes what the separate modules did, outside it exactly that; only the groups the model calls
on one input merge; the engine serving it gives mlx-lm's tokens."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from utils import assert_solo_greedy, make_prompts, run_staggered

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.loaders.random_model import RANDOM_ARCHS, random_model
from pagedmlx.layers.merged_linear import MergedLinear, MergedPart, merge_projections, merged_products
from pagedmlx.runner.model import weights_nbytes
from pagedmlx.sampling_params import SamplingParams


def _logits(model, tokens: list[int]) -> mx.array:
    from mlx_lm.models.cache import make_prompt_cache

    return model(mx.array([tokens]), cache=make_prompt_cache(model)).astype(mx.float32)


def _layers(model) -> list[nn.Module]:
    inner = getattr(model, "language_model", model)
    return getattr(inner, "model", inner).layers


@pytest.mark.parametrize("arch", ["llama-tiny", "qwen3-tiny", "gemma3-tiny", "olmo3-tiny", "gemma4-e-tiny",
                                  "qwen3_5-tiny"])
def test_merged_model_computes_what_the_separate_modules_did(arch):
    model = random_model(arch, 0)
    tokens = list(range(3, 40))
    want = _logits(model, tokens)
    nbytes = weights_nbytes(model)
    merged = merge_projections(model)
    assert merged > 0
    assert weights_nbytes(model) == nbytes  # the merged weights counted once
    assert mx.array_equal(_logits(model, tokens), want)  # outside the runner's forward: mlx-lm's own products
    with merged_products():
        got = _logits(model, tokens)
    assert mx.abs(got - want).max().item() <= 1e-4 * max(1.0, mx.abs(want).max().item())
    assert merge_projections(model) == 0  # nothing left to merge


def test_linear_attention_input_projections_merge():
    """Qwen3.5's Gated DeltaNet layers apply four projections to one input (qkv, z, b, a): one product."""
    model = random_model("qwen3_5-tiny", 0)
    merge_projections(model)
    layers = _layers(model)
    gdn = [layer.linear_attn for layer in layers if hasattr(layer, "linear_attn")]
    assert gdn
    for attn in gdn:
        parts = [attn[n] for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
        assert (sum(isinstance(p, MergedLinear) for p in parts) == 1
                and sum(isinstance(p, MergedPart) for p in parts) == 3)
        owner = next(p for p in parts if isinstance(p, MergedLinear))
        with merged_products():
            assert owner.merges(mx.zeros((1, 5, owner.linear.weight.shape[1])))  # read by a concatenate and gates


def test_attention_inputs_merge_for_single_rows_and_the_mlp_for_any():
    """A part of a merged product over several rows is a column slice, not row-contiguous: MLX's CUDA RoPE
    and custom kernels would copy q, k and v, so q/k/v take the merged product for one row only; gate/up
    (read by the activation, elementwise) for any."""
    model = random_model("llama-tiny", 0)
    merge_projections(model)
    layer = _layers(model)[0]
    width = layer.self_attn.q_proj.linear.weight.shape[1]
    one, many = mx.zeros((1, 1, width)), mx.zeros((3, 1, width))
    with merged_products():
        assert layer.self_attn.q_proj.merges(one) and not layer.self_attn.q_proj.merges(many)
        assert layer.mlp.gate_proj.merges(one) and layer.mlp.gate_proj.merges(many)
    assert not layer.mlp.gate_proj.merges(one)  # outside the runner's forward: mlx-lm's own products


def test_every_llama_layer_merges_both_groups():
    model = random_model("llama-tiny", 0)
    assert merge_projections(model) == 2 * len(_layers(model))
    for layer in _layers(model):
        assert isinstance(layer.self_attn.q_proj, MergedLinear)
        assert isinstance(layer.self_attn.k_proj, MergedPart) and isinstance(layer.self_attn.v_proj, MergedPart)
        assert isinstance(layer.mlp.gate_proj, MergedLinear) and isinstance(layer.mlp.up_proj, MergedPart)


def test_shared_kv_layers_keep_their_query_projection_alone():
    """Gemma-4 "E" models' last layers read another layer's keys and values: they call q_proj only, so
    their q/k/v are not merged (merging would compute keys and values nobody reads)."""
    model = random_model("gemma4-e-tiny", 0)
    merge_projections(model)
    shared = RANDOM_ARCHS["gemma4-e-tiny"]["num_kv_shared_layers"]
    layers = _layers(model)
    for layer in layers[-shared:]:
        assert type(layer.self_attn.q_proj) is nn.Linear
    assert isinstance(layers[0].self_attn.q_proj, MergedLinear)


def test_quantized_projections_merge():
    model = random_model("llama-tiny", 0)
    nn.quantize(model, group_size=32, bits=4)
    tokens = list(range(5, 30))
    want = _logits(model, tokens)
    assert merge_projections(model) == 2 * len(_layers(model))
    assert isinstance(_layers(model)[0].self_attn.q_proj.linear, nn.QuantizedLinear)
    assert mx.array_equal(_logits(model, tokens), want)
    with merged_products():
        got = _logits(model, tokens)
    assert mx.abs(got - want).max().item() <= 1e-4 * max(1.0, mx.abs(want).max().item())


def test_a_part_called_on_another_input_gets_that_inputs_product():
    linears = [nn.Linear(8, n, bias=True) for n in (8, 4, 4)]
    parent = nn.Module()
    for name, lin in zip(("q_proj", "k_proj", "v_proj"), linears):
        parent[name] = lin
    x, y = mx.random.normal((1, 1, 8)), mx.random.normal((1, 1, 8))  # q/k/v merge for single rows
    want = [lin(y) for lin in linears]
    from pagedmlx.layers.merged_linear import _merge_group

    assert _merge_group(parent, ("q_proj", "k_proj", "v_proj"), linears)
    with merged_products():
        assert mx.allclose(parent.q_proj(x), linears[0](x), atol=1e-5)
        assert parent.q_proj._input is x
        for name, w in zip(("k_proj", "v_proj", "q_proj"), want[1:] + want[:1]):  # y, out of the usual order
            assert mx.allclose(parent[name](y), w, atol=1e-5)
        assert parent.q_proj._input is None  # every part of y taken: no activation kept


@pytest.mark.parametrize("arch", ["llama-tiny", "qwen3-tiny", "gemma4-e-tiny", "qwen3_5-tiny"])
def test_engine_with_merged_projections_gives_mlx_lm_tokens(arch, monkeypatch):
    """Plain, shared-KV (Gemma-4 "E") and recurrent-state (Qwen3.5: its layers' rows regrouped by request)
    models, merged, busy: each request's tokens are mlx-lm's alone, on the same model object."""
    from pagedmlx.layers import merged_linear

    merged_calls = []
    part = merged_linear.MergedLinear.part
    monkeypatch.setattr(merged_linear.MergedLinear, "part",
                        lambda self, x, i: merged_calls.append(merged_linear._active.on) or part(self, x, i))
    model = random_model(arch, 0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[t % 448 for t in p] for p in make_prompts(12, 448, seed=5)]  # the smallest vocabulary (qwen3)
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=96,
                                                 max_num_seqs=6, merge_projections=True))
    assert engine.runner.merged_groups > 0
    from pagedmlx.runner.kernel_paths import kernel_path_lines

    assert f"projections: {engine.runner.merged_groups} groups each one matmul" in "\n".join(
        kernel_path_lines(engine.runner))
    done = run_staggered(engine, prompts, params, seed=1)
    assert True in merged_calls  # the engine's forward passes took the merged products
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, params.max_tokens, f"request {i}")



def test_a_runner_that_does_not_merge_computes_separately_on_a_merged_model():
    from utils import ARCHS, make_model

    reference = make_model("llama")
    model = random_model("llama-tiny", 0)
    merge_projections(model)  # as an earlier engine on the same model object would
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = make_prompts(6, ARCHS["llama"]["vocab_size"], seed=2)
    # at most 96 rows a step: MLX's CUDA RoPE fails to launch from 128 rows of this model's 4 heads of 16
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=96,
                                                 merge_projections=False))
    assert not engine.runner.merges
    done = run_staggered(engine, prompts, params, seed=1)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], reference, p, params.max_tokens, f"request {i}")


def test_merge_projections_defaults_to_the_gpu_backends():
    from pagedmlx.runner.model import _merges_projections

    on_gpu = mx.default_device() == mx.gpu
    assert _merges_projections(EngineConfig()) == on_gpu
    assert _merges_projections(EngineConfig(enable_lora=True)) == on_gpu
    assert _merges_projections(EngineConfig(merge_projections=True))
    assert not _merges_projections(EngineConfig(merge_projections=False))


def test_a_model_the_probe_cannot_run_keeps_its_projections(monkeypatch, caplog):
    from pagedmlx.layers import merged_linear

    def fail(*args):
        raise RuntimeError("no cache for this model")

    monkeypatch.setattr(merged_linear, "make_prompt_cache", fail)
    model = random_model("llama-tiny", 0)
    assert merge_projections(model) == 0
    assert type(_layers(model)[0].self_attn.q_proj) is nn.Linear
    assert "projections kept separate" in caplog.text


def test_a_single_stream_decodes_through_merged_attention_inputs(monkeypatch):
    """Batch-1 decode steps (one row) take q/k/v's merged product; the tokens stay mlx-lm's."""
    from pagedmlx.layers import merged_linear

    model = random_model("llama-tiny", 0)
    taken = []
    take = merged_linear.MergedLinear._take
    monkeypatch.setattr(merged_linear.MergedLinear, "_take",
                        lambda self, x, i: taken.append((self._any_rows, x.size == x.shape[-1])) or take(self, x, i))
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64, merge_projections=True))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = list(range(5, 29))
    engine.add_request("solo", prompt, params)
    done = {o.request_id: o.token_ids for o in iter_outputs(engine) if o.finished}
    assert (False, True) in taken  # q/k/v, merged, on single rows
    assert (False, False) not in taken  # ... and never on several
    assert_solo_greedy(done["solo"], model, prompt, params.max_tokens)


def iter_outputs(engine):
    while engine.has_unfinished_requests():
        yield from engine.step()
