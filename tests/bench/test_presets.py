"""The benchmark presets (pagedmlx/bench/presets.py): random weights at real models' widths, one per
family, each a valid config of its mlx-lm class (the Gemma 4 one with its per-layer head dims and
KV-shared tail; Qwen3.6-35B-A3B runs as qwen3_5_moe), and `preset:NAME` as a model argument: the
tokenizer padded to the preset's vocabulary, or a given one that sizes it, and `pagedmlx bench
throughput preset:NAME` end to end on the CPU-sized preset."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm.utils import _get_classes

from pagedmlx.bench.presets import PRESETS, preset_model
from pagedmlx.cli import main
from pagedmlx.loaders.loader import generation_defaults, load_model
from pagedmlx.loaders.random_model import tiny_tokenizer

FAMILIES = {"llama-8b": "llama", "gemma3-27b-16l": "gemma3_text", "gemma4-e2b-16l": "gemma4_text",
            "gemma4-e4b": "gemma4_text", "qwen3.5-27b-16l": "qwen3_5", "qwen3.5-35b-a3b-16l": "qwen3_5_moe",
            "qwen3.6-35b-a3b-16l": "qwen3_5_moe"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_valid_config_of_its_mlx_lm_class(name):
    """Built (lazily: MLX makes no weight until evaluated) by its mlx-lm class."""
    model_class, args_class = _get_classes(PRESETS[name])
    args = args_class.from_dict(PRESETS[name])
    assert len(model_class(args).layers) == PRESETS[name].get(
        "num_hidden_layers", PRESETS[name].get("text_config", {}).get("num_hidden_layers"))
    assert model_class.__module__.rsplit(".", 1)[1] == PRESETS[name]["model_type"]
    if name in FAMILIES:
        assert PRESETS[name]["model_type"] == FAMILIES[name]
    assert args.model_type in (PRESETS[name]["model_type"], PRESETS[name].get("text_config", {}).get("model_type"))


def test_the_gemma4_preset_has_both_head_dims_and_a_kv_shared_tail():
    args = _get_classes(PRESETS["gemma4-e2b-16l"])[1].from_dict(PRESETS["gemma4-e2b-16l"])
    full = [i for i, t in enumerate(args.layer_types) if t == "full_attention"]
    assert full == [4, 9, 14] and (args.head_dim, args.global_head_dim) == (256, 512)
    owners = args.num_hidden_layers - args.num_kv_shared_layers
    assert owners == 7 and {"full_attention", "sliding_attention"} <= set(args.layer_types[:owners])


def test_a_preset_model_argument_brings_a_tokenizer_of_its_vocabulary(tmp_path):
    model, tokenizer = load_model("preset:qwen3.5-tiny", dtype="float16")
    assert len(tokenizer._tokenizer) == 512 and model.language_model.model.embed_tokens.weight.dtype == mx.float16
    assert generation_defaults("preset:qwen3.5-tiny") == {}
    tiny_tokenizer(600)._tokenizer.save_pretrained(str(tmp_path))
    model, tokenizer = preset_model("qwen3.5-tiny", "float32", tokenizer=str(tmp_path))
    assert len(tokenizer._tokenizer) == 600 and model.language_model.model.embed_tokens.weight.shape[0] == 600
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        preset_model("preset:nope")


def test_bench_throughput_takes_a_preset(tmp_path, capsys):
    path = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "preset:qwen3.5-tiny", "--dtype", "float32", "--num-blocks", "128",
               "--max-model-len", "128", "--input-len", "16", "--output-len", "4", "--num-prompts", "4",
               "--disable-tqdm", "--output-json", str(path)])
    out = json.loads(path.read_text())
    assert rc == 0 and out["num_requests"] == 4 and out["total_output_tokens"] == 16
    assert capsys.readouterr().out.startswith("Throughput: ")


def test_quantization_specs_and_preset_name_suffixes():
    from pagedmlx.bench.presets import Quantization, parse_quantization, split_preset_name

    assert parse_quantization("4bit") == Quantization(4, 64) and parse_quantization(None) is None
    assert parse_quantization("4bit-g128-head8") == Quantization(4, 128, 8)
    assert parse_quantization("4bit-head8").suffix == "4bit-head8" and parse_quantization("8bit").suffix == "8bit"
    assert split_preset_name("preset:llama-8b-4bit") == ("llama-8b", Quantization(4, 64))
    assert split_preset_name("gemma3-27b-16l-8bit") == ("gemma3-27b-16l", Quantization(8, 64))
    assert split_preset_name("qwen3.5-35b-a3b-16l") == ("qwen3.5-35b-a3b-16l", None)
    for bad in ("7bit", "4bit-g48", "4-bit"):
        with pytest.raises(ValueError, match="unknown quantization"):
            parse_quantization(bad)
    with pytest.raises(ValueError, match="unknown preset 'llama-8b-7bit'"):
        preset_model("preset:llama-8b-7bit")


def test_a_quantized_preset_quantizes_layers_embeddings_and_head_as_asked():
    import mlx.nn as nn

    model, tokenizer = load_model("preset:small-4bit-head8", dtype="float16")
    layer = model.model.layers[0]
    assert (isinstance(layer.self_attn.q_proj, nn.QuantizedLinear)
            and isinstance(layer.mlp.down_proj, nn.QuantizedLinear))
    assert (layer.mlp.up_proj.bits, layer.mlp.up_proj.group_size, layer.mlp.up_proj.scales.dtype) == (4, 64, mx.float16)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding) and model.model.embed_tokens.bits == 8
    assert isinstance(model.lm_head, nn.QuantizedLinear) and model.lm_head.bits == 8
    assert len(tokenizer._tokenizer) == PRESETS["small"]["vocab_size"]
    model8, _ = preset_model("small-8bit", "float32")
    assert {model8.model.embed_tokens.bits, model8.lm_head.bits, model8.model.layers[1].mlp.gate_proj.bits} == {8}


@pytest.mark.slow  # a benchmark process of its own
def test_bench_offline_takes_a_quantization(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    path = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(root / "scripts/bench/bench_offline.py"), "--quantization", "4bit",
                           "--batch-sizes", "2", "--prompt-len", "8", "--gen-len", "4", "--skip-peer", "--json",
                           str(path)], capture_output=True, text=True, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(path.read_text())
    assert "4bit" in out["model"] and out["rows"][0]["batch"] == 2
