"""Decode attention dispatch: the CUDA paged-decode kernel where it runs, the gather path elsewhere.
The kernel itself is checked on a GPU (tests/test_gpu_kernels.py, skipped elsewhere); here, on the CPU,
the dispatch must fall back, and the kernel's launch arithmetic must be right."""

from __future__ import annotations

import mlx.core as mx
import pytest
from utils import make_model

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.kernels import build, decode_attention
from pagedmlx.runner import attention_metadata
from pagedmlx.runner.attention_metadata import StepMetadata
from pagedmlx.sampling_params import SamplingParams


@pytest.mark.skipif(mx.default_device() == mx.gpu, reason="what a machine without a GPU backend does")
def test_cpu_falls_back_to_the_gather_path():
    assert build.gpu_backend() is None
    engine = LLMEngine(make_model("llama"), None, EngineConfig(block_size=4, num_blocks=32))
    assert engine.runner.kernel_kv_heads == [0] and not engine.runner.pages_in_place
    assert not engine.runner.kernels.enabled and engine.runner.kernels.reason == "no GPU backend"
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    engine.step()
    so = engine.scheduler.schedule()  # a decode
    md = StepMetadata.build(so, 4, [None], engine.runner.kernel_kv_heads).groups[0]
    assert so.num_decodes == 1 and not md.use_decode_kernel and md.decode_mask is not None


def test_lane_layout_reads_whole_16_byte_vectors():
    assert decode_attention.lane_layout(128, mx.bfloat16) == (16, 8)  # 16 lanes x 8 bf16 = one 256-byte row
    assert decode_attention.lane_layout(64, mx.float32) == (16, 4)
    assert decode_attention.lane_layout(256, mx.float32) == (32, 8)
    assert decode_attention.lane_layout(96, mx.bfloat16) is None  # 12 lanes do not divide a warp
    assert not decode_attention.supports(80, 32, 8, mx.bfloat16)
    assert not decode_attention.supports(128, 32, 6, mx.bfloat16)  # heads not a multiple of KV heads
    assert decode_attention.supports(128, 28, 4, mx.bfloat16)  # G = 7
    assert decode_attention.supports_layer(128, 128, 28, 4, mx.bfloat16)
    assert not decode_attention.supports_layer(192, 128, 16, 16, mx.bfloat16)  # values narrower than keys (MLA-like)


def test_tensor_core_kernel_takes_16_bit_floats_whole_swizzle_groups_and_small_groups():
    assert decode_attention.supports_mma(128, 4, mx.bfloat16) and decode_attention.supports_mma(64, 1, mx.float16)
    assert decode_attention.supports_mma(256, 8, mx.bfloat16)
    assert not decode_attention.supports_mma(128, 4, mx.float32)  # no 16-bit operands
    assert not decode_attention.supports_mma(96, 4, mx.bfloat16)  # rows of 12 chunks do not swizzle in 8s
    assert not decode_attention.supports_mma(128, 16, mx.bfloat16)  # heads fill only rows 0..7 of the tile


def test_kernel_layout_takes_two_vectors_per_lane_only_where_registers_allow():
    assert decode_attention.kernel_layout(128, 4, mx.bfloat16, vectors=2) == (8, 16)  # Llama-8B: 8 lanes a token
    assert decode_attention.kernel_layout(128, 7, mx.bfloat16, vectors=2) == (16, 8)  # 7 x 16 > 64 registers: one
    assert decode_attention.kernel_layout(128, 4, mx.bfloat16, vectors=1) == (16, 8)
    assert decode_attention.kernel_layout(96, 4, mx.bfloat16, vectors=2) is None


def test_splits_cover_every_key_and_only_when_sms_would_idle():
    for batch, kv_heads, seq in [(1, 8, 32763), (32, 8, 4096), (64, 8, 1024), (256, 8, 256), (3, 2, 17)]:
        splits, tokens = decode_attention.num_splits(batch, kv_heads, seq)
        assert splits * tokens >= seq and (splits - 1) * tokens < seq  # no empty split, none missing
    assert decode_attention.num_splits(256, 8, 4096)[0] == 1  # 2,048 thread blocks already fill the GPU
    assert decode_attention.num_splits(1, 8, 200)[0] == 1  # short: not worth a merge pass
    assert decode_attention.num_splits(1, 8, 32763)[0] == 64  # 512 keys a split


def test_step_index_tensors_are_views_of_one_upload_and_equal_the_schedule():
    """AttentionMetadata sends the step's int32 index arrays to the device as one array; every
    tensor must still hold exactly its own part, for decodes, prefill chunks and placeholders."""
    import numpy as np

    from pagedmlx.request import Request
    from pagedmlx.core.sched.output import build_scheduler_output

    reqs = [Request("d", [5, 6, 7], SamplingParams(max_tokens=4)), Request("p", list(range(1, 12)), SamplingParams())]
    reqs[0].num_computed_tokens = 3
    blocks = {"d": ([3],), "p": ([0, 1, 2],)}
    so = build_scheduler_output([(reqs[0], 1), (reqs[1], 9)], blocks.__getitem__, 4, [], set())
    so.placeholder_rows, so.placeholder_src = np.array([0], np.int32), np.array([2], np.int32)
    step = StepMetadata.build(so, 4, [None])
    md = step.groups[0]
    for name in ("input_ids", "logits_indices", "placeholder_rows", "placeholder_src"):
        assert getattr(step, name).tolist() == getattr(so, name).tolist(), name
    assert md.positions.tolist() == so.positions.tolist()
    assert md.write_blocks.tolist() == (so.slot_mapping[0] // 4).tolist()
    assert md.write_offsets.tolist() == (so.slot_mapping[0] % 4).tolist()
    assert md.decode_block_table.tolist() == so.block_table[0, :1, :1].tolist()
    assert md.decode_seq_lens.tolist() == [4]
    (g,) = md.prefill_groups  # the short prompt's chunk, under an explicit mask
    assert g.block_table.tolist() == so.block_table[0, 1:, :3].tolist()
    assert g.query_rows.tolist() == list(range(9))  # among the prefill rows
    assert g.out_rows.tolist() == list(range(9)) and g.num_queries == 9 and g.num_keys == 12
    # Causal over the 12 gathered keys: query j (position j) sees keys 0..j.
    assert g.mask.tolist() == [[[[k <= j for k in range(12)] for j in range(9)]]]


def test_kernel_path_metadata_carries_slots_and_split_for_the_cuda_kernels():
    """What the CUDA path reads (built on any backend; the kernels themselves run on the GPU machine):
    slots for the in-place page write, the split size for the decode kernel, no scatter indices."""
    import numpy as np

    from pagedmlx.request import Request
    from pagedmlx.core.sched.output import build_scheduler_output

    long = Request("d", list(range(1, 601)), SamplingParams(max_tokens=4))
    long.num_computed_tokens = 600
    so = build_scheduler_output([(long, 1)], lambda rid: (list(range(151)),), 4, [], set())
    md = StepMetadata.build(so, 4, [None], kernel_kv_heads=[2], pages_in_place=True).groups[0]
    assert md.pages_in_place and md.use_decode_kernel and md.write_blocks is None
    assert md.slot_mapping.tolist() == so.slot_mapping[0].tolist() == [150 * 4 + 0]
    splits, tokens = decode_attention.num_splits(1, 2, 601)
    assert (md.decode_splits, md.decode_split_tokens.tolist()) == (splits, [tokens]) and splits > 1
    assert md.decode_block_table.shape == (1, 151) and md.decode_mask is None
    assert np.array_equal(np.array(md.decode_block_table), so.block_table[0, :1, :151])


def test_the_plan_sees_each_layers_query_heads_in_a_fresh_process(monkeypatch):
    """The kernel check needs every layer's query heads, which the plan's probe records through the
    attention dispatcher: it must be routed before the probe runs, also for the first model of a
    process (a module routed by an earlier test would hide it; on the H200 it left decode rows on
    the gather path)."""
    import mlx_lm.models.qwen3 as qwen3

    from pagedmlx.runner.model import ModelRunner

    original = getattr(qwen3.scaled_dot_product_attention, "_pagedmlx_original", None)
    if original is not None:
        monkeypatch.setattr(qwen3, "scaled_dot_product_attention", original)
    runner = ModelRunner(make_model("qwen3"), EngineConfig(block_size=4, num_blocks=16))
    assert [p.n_heads for p in runner.plan] == [4, 4] and not any(p.sinks for p in runner.plan)


def test_short_segments_run_as_decode_rows_where_the_kernel_runs(monkeypatch):
    """A decode and a 5-token prompt: with the decode kernel (KV heads > 0) each of the step's 6 tokens
    is a decode row on its request's pages with keys up to its own position; without it, or past the
    extra-reads bound, the prompt stays a prefill segment."""
    engine = LLMEngine(make_model("llama"), None, EngineConfig(block_size=4, num_blocks=32))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    engine.step()
    engine.add_request("b", [4, 5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0))
    so = engine.scheduler.schedule()
    assert so.num_decodes == 1 and so.total_num_scheduled_tokens == 6
    md = StepMetadata.build(so, 4, [None], [1]).groups[0]
    assert md.num_decodes == 6 and md.num_prefill_tokens == 0
    assert md.decode_seq_lens.tolist() == [4, 1, 2, 3, 4, 5]
    table = md.decode_block_table.tolist()
    assert table[0][:1] == so.block_table[0, 0, :1].tolist() and all(row == table[1] for row in table[2:])
    assert table[1][:2] == so.block_table[0, 1, :2].tolist()
    assert StepMetadata.build(so, 4, [None], [0]).groups[0].num_decodes == 1  # no kernel: the gather path
    monkeypatch.setattr(attention_metadata, "DECODE_ROWS_MAX_EXTRA_KEYS", 4 * 5 - 1)  # b reads 4 x 5 keys more
    assert StepMetadata.build(so, 4, [None], [1]).groups[0].num_decodes == 1
