"""The fused MoE product (kernels/fused_moe.py: the quantized GEMM kernel over a step's (token, expert) pairs
grouped by expert) run on the CPU in the kernel emulator: moe_align's grouping, the kernel's check against each
expert's dequantized weights, the check failing kernels that read the wrong expert, row or block; what only the GPU
shows: NVRTC's compile and speed."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from utils import (assert_no_leaks, emulated_busy_engine, float32_gather_qmm, float32_quantized_matmul, make_prompts,
                   run_staggered, solo_mismatch)

from pagedmlx.bench.presets import Quantization, quantize_model
from pagedmlx.kernels import build, fused_moe, quantized_gemm
from pagedmlx.kernels.dialect import CUDA
from pagedmlx.kernels.sources import fused_moe_cuda as align_src
from pagedmlx.kernels.sources import quantized_gemm_cuda as gemm_src
from pagedmlx.layers import fused_moe as fused_layer
from pagedmlx.layers import quantized_linear
from pagedmlx.loaders.random_model import RANDOM_ARCHS, build_model
from pagedmlx.runner import verify
from pagedmlx.runner.kernel_paths import kernel_path_lines
from pagedmlx.sampling_params import SamplingParams


@pytest.mark.parametrize("tokens,k,experts", [(1, 8, 256), (5, 2, 4), (64, 8, 256), (40, 2, 3), (300, 8, 16)])
def test_moe_align_puts_every_pair_once_in_a_block_of_its_expert(emulated_gemm, tokens, k, experts):
    rng = np.random.default_rng(tokens)
    route = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.uint32)  # as argpartition's
    b = fused_moe.moe_align(mx.array(route), experts)
    ids, block_experts = np.array(b.ids), np.array(b.experts)
    assert (np.array(b.pair_rows) == np.maximum(ids, 0)).all()  # empty slots read row 0
    assert (np.array(b.token_rows) == np.maximum(ids, 0) // k).all()
    n_blocks = block_experts.shape[0]  # one token: a block a pair; else enough for any routing
    assert n_blocks == (k if tokens == 1 else fused_moe.max_blocks(tokens * k, experts))
    assert ids.shape == (n_blocks * fused_moe.BLOCK_ROWS,)
    assert sorted(ids[ids >= 0].tolist()) == list(range(tokens * k))  # every pair exactly once
    blocks = ids.reshape(n_blocks, fused_moe.BLOCK_ROWS)
    flat = route.reshape(-1)
    for b, row in enumerate(blocks):
        live = row[row >= 0]
        assert (row[:live.size] >= 0).all()  # a block's pairs first, then -1
        if block_experts[b] < 0:
            assert live.size == 0
        else:
            assert live.size > 0 and (flat[live] == block_experts[b]).all()
    # the blocks past the last are the trailing ones
    used = block_experts >= 0
    assert not used[np.argmin(used):].any() if not used.all() else True


SHAPES = [(40, 256, 4, 64), (72, 160, 4, 32), (40, 256, 8, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=["4bit", "4bit-g32", "8bit"])
def test_emulated_fused_moe_passes_its_check(emulated_gemm, shape):
    """N not a whole number of 64-column tiles, K of 128-value chunks or not; one token, a few, and an expert with
    more pairs than a block takes; a token's row for each of its pairs, and a row per pair."""
    assert fused_moe.check_fused_moe([shape], 2, mx.bfloat16, tokens_checked=(1, 3, 37)) is None  # 2 and 4 warps


@pytest.mark.parametrize("original,wrong", [
    ("#define QG_EXPERT experts[GROUP_X]", "#define QG_EXPERT (experts[GROUP_X] > 0 ? 0 : experts[GROUP_X])"),
    ("#define QG_X_ROW(r) x_rows[m0 + (r)]", "#define QG_X_ROW(r) x_rows[m0]"),  # every slot the block's first row
    ("#define QG_OUT_ROW(m) ids[m]", "#define QG_OUT_ROW(m) ids[(m) & ~7]"),  # a block's rows onto its first
    ("#define QG_TILE_LIVE(mt) (ids[m0 + (mt) * 8] >= 0)", "#define QG_TILE_LIVE(mt) (ids[m0 + (mt) * 8 + 1] >= 0)"),
    ("+ (size_t)expert * N * row_groups;\n    const auto* wq", "+ 0;\n    const auto* wq"),  # another expert's biases
])
def test_the_check_fails_a_wrong_fused_moe(emulated_gemm, original, wrong):
    assert original in gemm_src.GROUPED_ROWS + gemm_src.QUANTIZED_GEMM
    emulated_gemm.setattr(gemm_src, "GROUPED_ROWS", gemm_src.GROUPED_ROWS.replace(original, wrong))
    emulated_gemm.setattr(gemm_src, "QUANTIZED_GEMM", gemm_src.QUANTIZED_GEMM.replace(original, wrong))
    err = fused_moe.check_fused_moe([(40, 256, 4, 64)], 2, mx.bfloat16, tokens_checked=(1, 21))
    assert err is not None and ("max relative difference" in err or "did not compile" in err)


@pytest.mark.parametrize("original,wrong", [
    ("token_rows[slot] = p / K;", "token_rows[slot] = p;"),  # the pair's row for a token's
    ("block += (counts[e] + BR - 1) / BR;", "block += counts[e] / BR;"),  # an expert's last block shared
    ("block_experts[first_block[e] + j] = e;", "block_experts[first_block[e] + j] = 0;"),  # every block expert 0
    ("cursor[e] = block * BR;", "cursor[e] = block * BR + 1;"),  # a block's first slot left empty
])
def test_the_check_fails_a_wrong_moe_align(emulated_gemm, original, wrong):
    assert original in align_src.MOE_ALIGN
    emulated_gemm.setattr(align_src, "MOE_ALIGN", align_src.MOE_ALIGN.replace(original, wrong))
    err = fused_moe.check_fused_moe([(40, 256, 4, 64)], 2, mx.bfloat16, tokens_checked=(3, 21))
    assert err is not None and ("max relative difference" in err or "did not compile or run" in err)


def test_the_dense_kernel_keeps_its_rows_prelude():
    text = quantized_gemm.quantized_gemm_source()
    assert "#define QG_N w_shape[0]" in text and "ids[" not in text




def _moe_model(family: str = "qwen3_5_moe-tiny") -> nn.Module:
    """A bf16 4-bit MoE: Qwen3.5-MoE with 16 experts, 4 a token; Gemma 4's MoE block (GeGLU experts) with 8, 2."""
    arch = RANDOM_ARCHS[family]
    if family == "qwen3_5_moe-tiny":
        arch = dict(arch, text_config=dict(arch["text_config"], num_experts=16, num_experts_per_tok=4))
    else:
        arch = dict(arch, num_experts=8)
    model = build_model(arch, seed=5)
    model.set_dtype(mx.bfloat16)
    quantize_model(model, Quantization(4, group_size=32))
    return model


@pytest.mark.parametrize("family,layers", [("qwen3_5_moe-tiny", 4), ("gemma4-moe-tiny", 6)])
def test_busy_engine_with_the_fused_moe_equals_mlx_lm_alone(emulated_gemm, family, layers):
    """Every MoE layer's experts of the engine's steps (decodes of up to 8 requests beside chunked prompts, one-token
    steps) run the fused kernel, and each request's tokens are mlx-lm's for its prompt alone, up to rounding's near
    ties."""
    emulated_gemm.setattr(mx, "gather_qmm", float32_gather_qmm())
    model = _moe_model(family)
    engine = emulated_busy_engine(model)
    runner = engine.runner
    assert not runner.fused_moe  # off by default on the CPU
    emulated_gemm.setattr(build, "gpu_backend", lambda: CUDA)
    emulated_gemm.setenv("PAGEDMLX_FUSED_MOE", "0")
    assert fused_layer.use_fused_moe(True, model, True) == 0  # turned off by name
    emulated_gemm.delenv("PAGEDMLX_FUSED_MOE")
    emulated_gemm.setenv("PAGEDMLX_FUSED_MOE_MIN_TOKENS", "1")  # one-token steps through the kernel too
    runner.fused_moe = fused_layer.use_fused_moe(True, model, True)  # its check, emulated
    emulated_gemm.setattr(build, "gpu_backend", lambda: None)
    assert runner.fused_moe == layers  # every layer's experts
    assert f"MoE experts: fused MoE kernel in {layers} layers" in "\n".join(kernel_path_lines(runner))
    tokens, real = [], fused_moe.moe_align
    emulated_gemm.setattr(fused_moe, "moe_align", lambda idx, e: tokens.append(idx.shape[0]) or real(idx, e))
    prompts = [p[:40] for p in make_prompts(10, 512, seed=13)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    done = run_staggered(engine, prompts, params, seed=3)
    assert 1 in tokens and max(tokens) > 8  # one-token steps and chunked prompts beside decodes
    for i, p in enumerate(prompts):
        why = solo_mismatch(done[str(i)], model, p, params.max_tokens)
        assert why is None, f"request {i}: {why}"
    assert_no_leaks(engine)
    fused_layer.drop_fused_moe(model)
    assert not any(getattr(m, "_kernel", False) for _, m in model.named_modules()
                   if type(m) is fused_layer.FusedSwitchGLU)


def test_a_fused_moe_the_model_check_refuses_gives_way_before_the_quantized_gemm(emulated_gemm):
    """The model's load-time check passes with both kernels on; where the fused MoE's experts go wrong after its own
    check, the model check drops it (back to gather_qmm) and keeps the quantized GEMM, which is right."""
    emulated_gemm.setattr(mx, "gather_qmm", float32_gather_qmm())
    emulated_gemm.setattr(mx, "quantized_matmul", float32_quantized_matmul())
    model = _moe_model()
    runner = emulated_busy_engine(model).runner
    emulated_gemm.setattr(build, "gpu_backend", lambda: CUDA)
    runner.quantized_gemm = quantized_linear.use_quantized_gemm(True, model, True)
    runner.fused_moe = fused_layer.use_fused_moe(True, model, True)
    emulated_gemm.setattr(build, "gpu_backend", lambda: None)
    assert runner.quantized_gemm and runner.fused_moe == 4
    verify.verify_against_mlx_lm(runner)
    assert runner.quantized_gemm and runner.fused_moe == 4  # right: both kept
    real = fused_moe.grouped_quantized_gemm
    emulated_gemm.setattr(fused_moe, "grouped_quantized_gemm", lambda *a: real(*a) * 4)
    verify.verify_against_mlx_lm(runner)
    assert runner.quantized_gemm and runner.fused_moe == 0


class _Kernel(Exception):
    """The step reached the fused MoE kernel's grouping."""


def test_steps_of_fewer_tokens_than_the_minimum_keep_gather_qmm(monkeypatch):
    model = _moe_model()
    fused_layer.fuse_switch_glus(model)
    layer = next(m for _, m in model.named_modules() if type(m) is fused_layer.FusedSwitchGLU)
    layer._kernel, layer._min_tokens = True, 8
    reached = []

    def align(indices, experts):
        reached.append(indices.shape[0])
        raise _Kernel

    monkeypatch.setattr(fused_moe, "moe_align", align)
    width, k = layer.gate_proj.weight.shape[-1] * 32 // layer.gate_proj.bits, 4
    with quantized_linear.flat_rows():
        for tokens in (1, 7):
            y = layer(mx.ones((tokens, 1, width), mx.bfloat16), mx.zeros((tokens, 1, k), mx.uint32))
            assert y.shape == (tokens, 1, k, width)  # gather_qmm's, as mlx-lm computes it
        with pytest.raises(_Kernel):
            layer(mx.ones((8, 1, width), mx.bfloat16), mx.zeros((8, 1, k), mx.uint32))
    assert reached == [8]
