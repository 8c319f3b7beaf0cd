"""Quantized KV pages (kv_cache_dtype int8 / int4): a busy engine gives each request the tokens mlx-lm's
QuantizedKVCache gives that prompt alone (quantized from the first token, same bits and group size);
hybrid models (windows, shared KV) give busy what they give solo on the same pages; the pool holds
>= 1.9x / >= 3.5x the tokens of bf16 pages in the same memory; bad values are refused."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import pytest
from utils import (ARCHS, QUANTIZED_GAP, Reference, assert_greedy, assert_no_leaks, engine_greedy, make_model,
                   make_prompts, mlx_lm_greedy, run_staggered)

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.core.kv.cache_dtype import KVQuant, bytes_per_token, layer_quant, normalize_kv_cache_dtype
from pagedmlx.loaders.random_model import RANDOM_ARCHS, build_model
from pagedmlx.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BITS = {"int8": 8, "int4": 4}


def mlx_lm_quantized(model, bits: int, group_size: int) -> Reference:
    """mlx-lm alone, its keys and values quantized from the first token (QuantizedKVCache per layer)."""
    from mlx_lm.models.cache import QuantizedKVCache

    return partial(mlx_lm_greedy, model, make_cache=lambda: [QuantizedKVCache(group_size, bits) for _ in model.layers])


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_busy_quantized_pages_equal_mlx_lm_quantized_cache(kv_cache_dtype):
    """Staggered arrivals, chunked prefill, preemption and prefix hits on int8 / int4 pages: every
    request's greedy tokens equal mlx-lm's QuantizedKVCache alone. Exact up to rounding: a key is quantized per
    token over its head's channels, so both hold the same values whatever the chunking, but for a float32 product's
    last bit that lands a value on the other side of a rounding boundary (utils.QUANTIZED_GAP)."""
    model = make_model("qwen3")  # head_dim 32: one group of 32
    prompts = make_prompts(24, ARCHS["qwen3"]["vocab_size"], seed=7)
    config = EngineConfig(block_size=4, num_blocks=120, max_num_batched_tokens=96, long_prefill_token_threshold=48,
                          max_num_seqs=16, kv_cache_dtype=kv_cache_dtype)
    engine = LLMEngine(model, None, config)
    assert engine.runner.kv_pool.quant[0] == KVQuant(BITS[kv_cache_dtype], 32)
    done = run_staggered(engine, prompts, GREEDY, seed=3)
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache_manager.stats.hits > 0
    reference = mlx_lm_quantized(model, BITS[kv_cache_dtype], 32)
    for i, p in enumerate(prompts):
        assert_greedy(done[str(i)], p, GREEDY.max_tokens, reference, f"request {i} (prompt {len(p)} tokens)",
                      QUANTIZED_GAP)
    assert_no_leaks(engine)


def _hybrid(arch: str):
    """A tiny hybrid model of `arch` with head_dim 32 (mx.quantize's smallest group)."""
    cfg = dict(RANDOM_ARCHS[arch])
    if "text_config" in cfg:
        cfg["text_config"] = dict(cfg["text_config"], head_dim=32)
    else:
        cfg.update(head_dim=32, **({"global_head_dim": 64} if "global_head_dim" in cfg else {}))
    return build_model(cfg, seed=1)


@pytest.mark.parametrize("arch", ["gemma3-tiny", "gemma4-e-tiny"])
def test_hybrid_busy_equals_solo_on_int8_pages(arch):
    """Sliding-window and KV-shared layers on quantized pages: busy == each prompt alone on the same engine setup
    (mlx-lm has no quantized rotating cache to compare with)."""
    model = _hybrid(arch)
    vocab = model.args.vocab_size if hasattr(model.args, "vocab_size") else 512
    prompts = make_prompts(10, vocab, seed=11)

    def engine(max_num_seqs: int) -> LLMEngine:
        return LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=200, max_num_batched_tokens=64,
                                                   long_prefill_token_threshold=24, max_num_seqs=max_num_seqs,
                                                   kv_cache_dtype="int8"))
    busy = engine(8)
    assert any(q is not None for q in busy.runner.kv_pool.quant)
    done = run_staggered(busy, prompts, GREEDY, seed=5)
    assert_no_leaks(busy)
    solo = engine_greedy(engine(1), GREEDY)
    for i, p in enumerate(prompts):
        assert_greedy(done[str(i)], p, GREEDY.max_tokens, solo, f"request {i}", QUANTIZED_GAP)


def test_capacity_per_token_against_bf16():
    """Llama-8B's and Gemma-3-27B's KV shapes (8 / 16 KV heads of 128): tokens per byte against bf16 pages."""
    for n_kv in (8, 16):
        bf16 = bytes_per_token(n_kv, 128, 128, 2, None)
        for dtype, least in (("int8", 1.9), ("int4", 3.5)):
            q = layer_quant(dtype, None, 128, 128)
            assert bf16 / bytes_per_token(n_kv, 128, 128, 2, q) >= least, (dtype, q)


def test_pool_holds_more_tokens_in_the_same_memory():
    """The block pool sized from one memory budget: blocks (tokens) of int8 / int4 pages against bf16."""
    cfg = dict(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=256,
               num_attention_heads=2, num_key_value_heads=1, head_dim=128, rms_norm_eps=1e-5, vocab_size=256)
    model = build_model(cfg)
    model.set_dtype(mx.bfloat16)
    blocks = {}
    for dtype in ("auto", "int8", "int4"):
        runner = LLMEngine(model, None, EngineConfig(block_size=16, kv_cache_memory_gb=0.01, max_num_seqs=4,
                                                     kv_cache_dtype=dtype)).runner
        blocks[dtype] = runner.num_blocks
        assert runner.kv_pool.nbytes <= 0.01e9
    assert blocks["int8"] >= 1.9 * blocks["auto"]
    assert blocks["int4"] >= 3.5 * blocks["auto"]


def test_bad_values_refused():
    for bad in ("fp8", "int3", "bf8"):
        with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, int8, int4, got") as e:
            EngineConfig(kv_cache_dtype=bad)
        assert repr(bad) in str(e.value)
    with pytest.raises(ValueError, match="kv_cache_group_size must be one of 32, 64, 128"):
        EngineConfig(kv_cache_dtype="int4", kv_cache_group_size=48)
    with pytest.raises(ValueError, match="quantized pages only"):
        EngineConfig(kv_cache_group_size=32)
    assert normalize_kv_cache_dtype("Q8") == "int8" and normalize_kv_cache_dtype(None) == "auto"
    with pytest.raises(ValueError, match="divides the head dims 16/16"):  # llama-tiny: head_dim 16
        LLMEngine(make_model("llama"), None, EngineConfig(num_blocks=16, kv_cache_dtype="int8"))


def test_cli_flag():
    import argparse

    from pagedmlx.engine.arg_utils import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config(p.parse_args(["--kv-cache-dtype", "int4", "--kv-cache-group-size", "32"]))
    assert (cfg.kv_cache_dtype, cfg.kv_cache_group_size) == ("int4", 32)
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "fp8"])


def test_reports_name_the_pages_and_their_bytes_per_token():
    """The start-up line (and doctor), the inspector's snapshot and /metrics: bytes per token by layer kind."""
    from pagedmlx.blocks.snapshot import kv_snapshot
    from pagedmlx.engine.core_info import kv_pool_line
    from pagedmlx.server.metrics import EngineSnapshot, ServerMetrics

    model = _hybrid("gemma3-tiny")  # 4 sliding layers and 2 full ones, 2 KV heads of 32, float32
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64, max_model_len=256, kv_cache_dtype="int8"))
    per_layer = 2 * 2 * (32 + 2 * 4)  # keys and values, 2 heads: 32 int8 values and a float32 scale and bias
    line = kv_pool_line(engine)
    assert f"int8 pages, {2 * per_layer:,} B/token" in line and f"int8 pages, {4 * per_layer:,} B/token" in line, line
    groups = {g["name"]: g for g in kv_snapshot(engine)["groups"]}
    assert groups["full"]["bytes_per_token"] == 2 * per_layer and groups["full"]["kv_cache_dtype"] == "int8"
    metrics = ServerMetrics("m")
    metrics.update(EngineSnapshot.take(engine))
    text = metrics.render().decode()
    lines = [x for x in text.splitlines() if x.startswith("pagedmlx:kv_cache_bytes_per_token{")]
    assert len(lines) == 2 and all('kv_cache_dtype="int8"' in x for x in lines), lines
    assert any('kv_cache_group="full"' in x and x.endswith(f" {2.0 * per_layer}") for x in lines), lines
    auto = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64, max_model_len=256))
    assert f"float32 pages, {2 * 2 * 2 * 32 * 4:,} B/token" in kv_pool_line(auto)


def test_doctor_table_names_the_quantized_pages():
    import argparse

    from rich.console import Console

    from pagedmlx.cli.doctor import kernel_paths_table

    console = Console(width=400, record=True)
    console.print(kernel_paths_table("random:qwen3-tiny", argparse.Namespace(block_size=16, dtype="float32",
                                                                             kv_cache_dtype="int4"), mx.float32)[0])
    text = console.export_text()
    assert "over int4 pages (group 32)" in text and f"full: {2 * 2 * 2 * (16 + 2 * 4):,} B/token of int4 pages" in text


def test_speculative_decoding_on_int4_pages_gives_the_same_tokens():
    """Drafts verified as query tokens read the quantized pages as prefill rows do: greedy output unchanged."""
    from utils import make_tokenizer

    from pagedmlx import LLM

    model, tok = make_model("qwen3"), make_tokenizer(ARCHS["qwen3"]["vocab_size"])
    prompts = [[1, 2, 3, 4] * 9, [7, 8, 9] * 10]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def llm(**kw):
        return LLM(model, tok, kv_cache_dtype="int4", num_blocks=64, max_model_len=256, **kw)
    outs = llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).generate(prompts, greedy)
    plain = engine_greedy(llm().engine, greedy)
    for p, out in zip(prompts, outs):
        assert_greedy(out.outputs[0].token_ids, p, greedy.max_tokens, plain, p, QUANTIZED_GAP)
