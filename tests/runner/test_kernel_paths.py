"""Which kernel each layer runs, said out loud (runner/kernel_paths.py): the lines `pagedmlx doctor`
and the server's start-up print, per KV cache group. On the CPU every layer of every family runs the
portable path, for the reason the kernel plan gives; where a GPU backend is only simulated, the
lines follow the same gates the step uses (the plan, each layer's head shape), and a model whose
load-time check fails says the check's message."""

from __future__ import annotations

import argparse

import mlx.core as mx
import pytest
from utils import make_model

from pagedmlx.config import EngineConfig
from pagedmlx.engine.core_info import CoreInfo
from pagedmlx.cli.doctor import kernel_paths_table
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.kernels import build, selector
from pagedmlx.kernels.selector import KernelPlan
from pagedmlx.loaders.random_model import build_model
from pagedmlx.runner.kernel_paths import kernel_path_lines, layer_list
from pagedmlx.runner.model import ModelRunner

PORTABLE = "decode gather + SDPA; prefill gather + SDPA; page write MLX scatter"
STATE = "update mlx-lm's own code, states scattered into the pool"
ON_THE_CPU = {
    "llama-tiny": [f"full (layers 0-1): {PORTABLE} (no GPU backend)"],
    "gemma3-tiny": [f"full (layers 2, 5): {PORTABLE} (no GPU backend)",
                    f"sliding 8 (layers 0-1, 3-4): {PORTABLE} (no GPU backend)"],
    "qwen3_5-tiny": [f"full (layers 1, 3): {PORTABLE} (no GPU backend)",
                     f"state (layers 0, 2): {STATE} (no GPU backend)"],
    "gemma4-e-tiny": [f"full (layer 2, KV shared by layer 5): {PORTABLE} (no GPU backend)",
                      f"sliding 8 (layers 0-1, 3, KV shared by layer 4): {PORTABLE} (no GPU backend)"],
}


def engine(arch: str, **config) -> LLMEngine:
    # a model of its own: a dtype in config casts it (make_model's are shared by every test)
    model = make_model.__wrapped__(arch) if config.get("dtype") else make_model(arch)
    return LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64, **config))


def test_layer_lists_are_runs():
    assert layer_list([7, 0, 1, 2, 5, 8]) == "0-2, 5, 7-8" and layer_list([3]) == "3"


@pytest.mark.parametrize("arch", sorted(ON_THE_CPU))
def test_on_the_cpu_every_layer_of_every_family_runs_the_portable_path(arch):
    e = engine(arch)
    assert kernel_path_lines(e.runner) == ON_THE_CPU[arch]
    assert CoreInfo.of(e.core).kernel_lines == ON_THE_CPU[arch]  # what the server prints at start


def test_a_lora_engine_says_what_runs_its_adapters():
    e = engine("llama", enable_lora=True, max_loras=2, max_lora_rank=8)
    assert kernel_path_lines(e.runner)[-1] == "LoRA adapters: MLX's stacked products (no GPU backend)"
    e.runner.lora_manager.punica.kernel_backend = "cuda"
    assert kernel_path_lines(e.runner)[-1] == "LoRA adapters: batched LoRA kernel on cuda (DoRA rows: MLX's products)"


def llama_bf16(head_dim: int = 128, heads: int = 4, kv_heads: int = 1):
    model = build_model(dict(model_type="llama", hidden_size=heads * head_dim, num_hidden_layers=2,
                             intermediate_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=head_dim, vocab_size=512, rms_norm_eps=1e-5, tie_word_embeddings=False))
    model.set_dtype(mx.bfloat16)
    return model


def test_a_cuda_plan_names_each_kernel_and_each_shape_it_does_not_take():
    runner = ModelRunner(llama_bf16(), EngineConfig(block_size=16, num_blocks=8), verify=False)
    runner.kernels = KernelPlan("cuda", decode=True, page_write=True, prefill=True)
    assert kernel_path_lines(runner) == [
        "full (layers 0-1): decode paged decode kernel on tensor cores; prefill paged prefill kernel (steps whose "
        "chunks are all <= 256 tokens; longer: gather + SDPA); page write kernel, in place"]
    runner = ModelRunner(llama_bf16(head_dim=256), EngineConfig(block_size=16, num_blocks=8), verify=False)
    runner.kernels = KernelPlan("cuda", decode=True, page_write=True, prefill=True)
    assert kernel_path_lines(runner) == [
        "full (layers 0-1): decode paged decode kernel on tensor cores; prefill gather + SDPA (head_dim 256 (built "
        "for 64, 128)); page write kernel, in place"]
    runner.kernels = KernelPlan("cuda", decode=True, page_write=True, prefill_reason="--no-prefill-kernel")
    assert "prefill gather + SDPA (--no-prefill-kernel)" in kernel_path_lines(runner)[0]


def test_a_cuda_plan_over_quantized_pages_names_the_tensor_core_kernel_and_the_in_place_write(monkeypatch):
    """What bench_kv_quant.py --speed prints as its decode path: tensor cores where CUDA's 16-bit kernel runs
    them, the lanes kernel where PAGEDMLX_DECODE_MMA=0 (or on Metal)."""
    from pagedmlx.kernels import decode_attention

    runner = ModelRunner(llama_bf16(), EngineConfig(block_size=16, num_blocks=8, kv_cache_dtype="int8"), verify=False)
    runner.kernels = KernelPlan("cuda", decode=True, page_write=True, prefill_reason="x")
    assert kernel_path_lines(runner)[0].startswith(
        "full (layers 0-1): decode paged decode kernel over int8 pages (group 128) on tensor cores; prefill gather + "
        "SDPA (x); page write kernel, in place")
    lanes = decode_attention.SETTINGS["cuda"].__class__(**{**decode_attention.SETTINGS["cuda"].__dict__, "mma": 0})
    monkeypatch.setitem(decode_attention.SETTINGS, "cuda", lanes)
    assert "decode paged decode kernel over int8 pages (group 128);" in kernel_path_lines(runner)[0]
    monkeypatch.undo()
    runner.kernels = KernelPlan("metal", decode=True, prefill_reason="x")
    assert "decode paged decode kernel over int8 pages (group 128);" in kernel_path_lines(runner)[0]
    runner.kernels = KernelPlan("cuda", decode=True, prefill_reason="x", page_write_reason="page write int8/128 "
                                "kv=1 D=128: failed: the pages differ")
    assert kernel_path_lines(runner)[0].endswith("page write MLX scatter (page write int8/128 kv=1 D=128: failed: the "
                                                 "pages differ)")


def test_a_layer_shape_the_decode_kernel_does_not_take_is_named():
    runner = ModelRunner(llama_bf16(head_dim=8, heads=4, kv_heads=2), EngineConfig(block_size=16, num_blocks=8),
                         verify=False)
    runner.kernels = KernelPlan("metal", decode=True)
    assert kernel_path_lines(runner) == [
        "full (layers 0-1): decode gather + SDPA (head_dim 8 < 16); prefill gather + SDPA (kernels off); "
        "page write MLX scatter (not in place on metal yet)"]


def test_a_state_model_on_cuda_names_the_state_kernels():
    e = engine("qwen3_5-tiny", dtype="bfloat16")
    e.runner.kernels = KernelPlan("cuda", decode=True, page_write=True, state=True, prefill_reason="x")
    assert kernel_path_lines(e.runner)[-1] == (
        "state (layers 0, 2): update recurrent-state kernels (gated delta rule, short convolution; states written "
        "in place)")


def test_a_failed_load_time_check_is_the_reason_given(monkeypatch):
    """The CUDA kernels selected (a trusted GPU, so no kernel check first), then the model's load-time
    check runs them; here they cannot run (no CUDA), the check's message switches them off and is
    what every portable path names: the Gemma-4 case, said out loud."""
    monkeypatch.setattr(build, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(selector, "device_name", lambda: "NVIDIA H200")
    e = engine("qwen3_5-tiny")
    reason = e.runner.kernels.reason
    assert reason.startswith("the model's paged forward disagrees with mlx-lm (")
    assert kernel_path_lines(e.runner) == [f"full (layers 1, 3): {PORTABLE} ({reason})",
                                           f"state (layers 0, 2): {STATE} ({reason})"]


def test_doctor_prints_each_models_kernel_paths():
    from rich.console import Console

    console = Console(width=400, record=True)
    args = argparse.Namespace(block_size=16, dtype="float32")
    for name in ("random:llama-tiny", "random:qwen3_5-tiny"):
        console.print(kernel_paths_table(name, args, mx.float32)[0])
    text = console.export_text()
    assert "which kernel each layer runs: random:qwen3_5-tiny" in text
    assert f"state (layers 0, 2) │ {STATE} (no GPU backend)" in text
    assert f"│ full (layers 0-1) │ {PORTABLE} (no GPU backend) │" in text


def test_gemma4_e2b_head_shapes_on_cuda_say_which_layers_leave_the_kernels():
    """The gemma4-e2b-16l preset's attention shapes (8 query heads over one KV head; head_dim 256 on
    sliding layers, 512 on full ones), narrow otherwise: what a CUDA plan runs for each group."""
    cfg = dict(model_type="gemma4_text", hidden_size=64, num_hidden_layers=10, intermediate_size=64,
               num_attention_heads=8, head_dim=256, global_head_dim=512, num_key_value_heads=1, num_kv_shared_layers=4,
               hidden_size_per_layer_input=16, vocab_size=512, vocab_size_per_layer_input=512, sliding_window=512,
               sliding_window_pattern=5, final_logit_softcapping=30.0, use_double_wide_mlp=True, rms_norm_eps=1e-6,
               max_position_embeddings=4096, tie_word_embeddings=True)
    model = build_model(cfg)
    model.set_dtype(mx.bfloat16)
    runner = ModelRunner(model, EngineConfig(block_size=16, num_blocks=8), verify=False)
    runner.kernels = KernelPlan("cuda", decode=True, page_write=True, prefill_reason="no layer shape the prefill "
                                                                                     "kernel takes")
    assert kernel_path_lines(runner) == [
        "full (layer 4, KV shared by layer 9): decode gather + SDPA (no lane layout for head_dim 512 with 8 query "
        "heads per KV head); prefill gather + SDPA (no layer shape the prefill kernel takes); page write kernel, "
        "in place",
        "sliding 512 (layers 0-3, 5, KV shared by layers 6-8): decode paged decode kernel on tensor cores; prefill "
        "gather + SDPA (no layer shape the prefill kernel takes); page write kernel, in place"]
