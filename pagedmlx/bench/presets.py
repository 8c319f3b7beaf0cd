"""Random-weight models at real widths, one preset per family, for the benchmarks: mlx-lm's own model
classes with the real models' shapes (fewer layers where the name says so). `preset:NAME` is a model
argument wherever one is taken (`pagedmlx bench throughput preset:llama-8b --dtype bfloat16`, `serve`,
`doctor --model`, `LLM(...)`: pagedmlx/loaders/loader.py), and scripts/bench/* and scripts/export_mlx_model.py
build them here too (preset_model).

A preset's name may end in a quantization, NAME-<bits>bit[-g<group size>][-head<bits>]: `preset:llama-8b-4bit`
(affine, group size 64), `preset:llama-8b-8bit`, `preset:llama-8b-4bit-head8` (embeddings and LM head at 8 bits,
the rest at 4). The weights are drawn in the dtype, then quantized by mlx.nn.quantize as mlx-lm's convert does."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

import mlx.core as mx

from pagedmlx.loaders.random_model import RANDOM_ARCHS, tiny_tokenizer
from pagedmlx.loaders.random_model import vocab_size as config_vocab_size

PRESET_PREFIX = "preset:"

_LLAMA = dict(model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False)
PRESETS = {
    "small": dict(_LLAMA, hidden_size=512, num_hidden_layers=8, intermediate_size=1408, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=32000),
    "llama-8b": dict(_LLAMA, hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    # Gemma 3 27B's widths, 16 of its 62 layers (pattern 6: 5 sliding layers of window 1024 per full one).
    "gemma3-27b-16l": dict(model_type="gemma3_text", hidden_size=5376, num_hidden_layers=16, intermediate_size=21504,
                           num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168,
                           sliding_window=1024, sliding_window_pattern=6, vocab_size=262208, rms_norm_eps=1e-6,
                           max_position_embeddings=131072, rope_theta=1000000.0, rope_local_base_freq=10000.0),
    "gemma3-small": dict(model_type="gemma3_text", hidden_size=512, num_hidden_layers=6, intermediate_size=1408,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, sliding_window=256,
                         sliding_window_pattern=3, vocab_size=32000, max_position_embeddings=65536),
}


# Models with recurrent state: real widths, 16 layers (every 4th full attention, the others Gated DeltaNet).
_QWEN35 = dict(model_type="qwen3_5", num_hidden_layers=16, full_attention_interval=4, head_dim=256,
               linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
               vocab_size=248320, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=262144,
               rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
PRESETS.update({
    "qwen3.5-27b-16l": dict(model_type="qwen3_5", text_config=dict(
        _QWEN35, model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
        num_key_value_heads=4, linear_num_value_heads=48)),
    "qwen3.5-35b-a3b-16l": dict(model_type="qwen3_5_moe", text_config=dict(
        _QWEN35, model_type="qwen3_5_moe_text", hidden_size=2048, intermediate_size=512, num_attention_heads=16,
        num_key_value_heads=2, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
        decoder_sparse_step=1, moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True)),
    "qwen3.5-tiny": RANDOM_ARCHS["qwen3_5-tiny"],  # pagedmlx's random:qwen3_5-tiny, for a run on the CPU
    # "small"'s widths in Qwen3.5's shape (8 layers: 2 full attention, 6 Gated DeltaNet), for CPU runs
    # of what the recurrent state costs (speculative decoding's rollback: scripts/bench/bench_spec.py).
    "qwen3.5-small": dict(model_type="qwen3_5", text_config=dict(
        _QWEN35, model_type="qwen3_5_text", num_hidden_layers=8, hidden_size=512, intermediate_size=1408,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=32000, max_position_embeddings=65536)),
})
# Qwen3.6-35B-A3B: mlx-lm has no class of its own for it (0.32: its checkpoints run as qwen3_5_moe), so
# the Qwen3.5-35B-A3B preset is its shape too, under its name as well.
PRESETS["qwen3.6-35b-a3b-16l"] = PRESETS["qwen3.5-35b-a3b-16l"]

# Gemma 4 (mlx-lm's gemma4_text), "E" style: sliding layers of head_dim 256 and full layers of 512 (one
# per 5), one KV head, a tail of KV-shared layers that read the last owner of their kind, per-layer
# inputs, double-wide MLPs in the shared layers, soft-capped logits. The widths are Gemma 4 E2B's (mlx-lm's
# ModelArgs defaults: hidden 1536, 8 heads, vocabulary 262,144, window 512); 16 of its 35 layers, 9 of
# them KV-shared (its 20 of 35, scaled).
PRESETS["gemma4-e2b-16l"] = dict(
    model_type="gemma4_text", hidden_size=1536, num_hidden_layers=16, intermediate_size=6144, num_attention_heads=8,
    head_dim=256, global_head_dim=512, num_key_value_heads=1, num_kv_shared_layers=9, hidden_size_per_layer_input=256,
    vocab_size=262144, vocab_size_per_layer_input=262144, sliding_window=512, sliding_window_pattern=5,
    final_logit_softcapping=30.0, use_double_wide_mlp=True, rms_norm_eps=1e-6, max_position_embeddings=131072,
    tie_word_embeddings=True)


# Gemma 4 E4B's widths, all 42 layers (18 of them KV-shared): hidden 2560, 8 heads over 2 KV heads, MLP 10240;
# the seed's first model ("a Gemma-4-E4B-like shape" of the quantized benchmarks: preset:gemma4-e4b-4bit).
PRESETS["gemma4-e4b"] = dict(
    model_type="gemma4_text", hidden_size=2560, num_hidden_layers=42, intermediate_size=10240, num_attention_heads=8,
    head_dim=256, global_head_dim=512, num_key_value_heads=2, num_kv_shared_layers=18, hidden_size_per_layer_input=256,
    vocab_size=262144, vocab_size_per_layer_input=262144, sliding_window=512, sliding_window_pattern=6,
    final_logit_softcapping=30.0, rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=True)

@dataclass(frozen=True)
class Quantization:
    """Weight quantization of a preset: `bits` for the layers, `head_bits` for the embeddings and the LM head (None:
    `bits`); `mode` is MLX's (affine, or a microscaled mxfp4 / mxfp8 / nvfp4 with its own group size)."""

    bits: int
    group_size: int = 64
    head_bits: Optional[int] = None
    mode: str = "affine"

    @property
    def suffix(self) -> str:
        return (f"{self.bits}bit" + (f"-g{self.group_size}" if self.group_size != 64 else "")
                + (f"-head{self.head_bits}" if self.head_bits not in (None, self.bits) else ""))


_QUANT = re.compile(r"(?P<bits>[234568])bit(?:-g(?P<group>32|64|128))?(?:-head(?P<head>[234568]))?")


def parse_quantization(spec: Optional[str]) -> Optional[Quantization]:
    """`4bit`, `8bit`, `4bit-g128`, `4bit-head8` (see the module docstring); None or "" or "none": no quantization."""
    if not spec or spec == "none":
        return None
    m = _QUANT.fullmatch(spec)
    if m is None:
        raise ValueError(f"unknown quantization {spec!r}: <bits>bit[-g<group size>][-head<bits>], bits 2-6 or 8, "
                         "group size 32, 64 or 128 (e.g. 4bit, 8bit, 4bit-head8)")
    return Quantization(int(m["bits"]), int(m["group"] or 64), int(m["head"]) if m["head"] else None)


def split_preset_name(name: str) -> tuple[str, Optional[Quantization]]:
    """(preset, quantization) of a preset name with or without the prefix and a quantization suffix."""
    name = name[len(PRESET_PREFIX):] if name.startswith(PRESET_PREFIX) else name
    for base in sorted(PRESETS, key=len, reverse=True):
        if name.startswith(base + "-") and _QUANT.fullmatch(name[len(base) + 1:]):
            return base, parse_quantization(name[len(base) + 1:])
    return name, None


def quantize_model(model, q: Quantization) -> None:
    """The model's linear layers and embeddings quantized in place (mlx.nn.quantize, mlx-lm convert's rules:
    layers whose input width the group size divides, the model's own quant_predicate); embeddings and LM head
    at q.head_bits where given."""
    import mlx.nn as nn

    own = getattr(model, "quant_predicate", None)

    def predicate(path: str, m) -> Union[bool, dict]:
        if not hasattr(m, "to_quantized") or m.weight.shape[-1] % q.group_size:
            return False
        verdict = own(path, m) if own is not None else True
        if verdict is True and q.head_bits and (isinstance(m, nn.Embedding) or path.split(".")[-1] == "lm_head"):
            return dict(group_size=q.group_size, bits=q.head_bits, mode=q.mode)
        return verdict

    nn.quantize(model, q.group_size, q.bits, mode=q.mode, class_predicate=predicate)
    mx.eval(model.parameters())


def random_model(preset: str, dtype: mx.Dtype, vocab_size: Optional[int] = None,
                 quantization: Optional[Quantization] = None):
    """A random-weight model of the preset's architecture (mlx-lm's own class), in `dtype` (quantized after the
    draw where `quantization` says so); `vocab_size` replaces the preset's (a tokenizer's own size)."""
    from mlx_lm.utils import _get_classes

    cfg = dict(PRESETS[preset])
    if vocab_size is not None:
        inner = cfg.get("text_config")
        if inner is not None:
            cfg["text_config"] = dict(inner, vocab_size=vocab_size)
        cfg["vocab_size"] = vocab_size
        if "vocab_size_per_layer_input" in cfg:  # gemma4: per-layer inputs are embedded by token id too
            cfg["vocab_size_per_layer_input"] = vocab_size
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(cfg))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    if quantization is not None:
        quantize_model(model, quantization)
    return model


def preset_model(name: str, dtype: Union[str, mx.Dtype, None] = None, tokenizer: Optional[str] = None):
    """(model, tokenizer) of `preset:NAME` (or NAME; a quantization suffix quantizes it: module docstring), in
    `dtype` (default bfloat16; a quantized model's scales and unquantized layers), the tokenizer
    wrapped as mlx-lm wraps it. `tokenizer`, a folder or hub name with tokenizer files, sizes the model's
    vocabulary to it (served benchmarks then detokenize real text); without one, pagedmlx's tiny
    tokenizer padded to the preset's own vocabulary, so that the LM head keeps its real width and every
    id a random model samples decodes."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    name, quantization = split_preset_name(name)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))} (quantized: "
                         "NAME-4bit, NAME-8bit, NAME-4bit-head8, ...)")
    dtype = getattr(mx, dtype) if isinstance(dtype, str) else dtype or mx.bfloat16
    if tokenizer is None:
        return random_model(name, dtype, quantization=quantization), tiny_tokenizer(config_vocab_size(PRESETS[name]))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer)
    return random_model(name, dtype, vocab_size=len(hf), quantization=quantization), TokenizerWrapper(hf)
