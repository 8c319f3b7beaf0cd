"""The GGUF architectures pagedmlx maps onto mlx-lm models: for each, mlx-lm's ModelArgs from the file's
metadata, the tensor names, and the undoing of what llama.cpp's converter (convert_hf_to_gguf.py) did
to the Hugging Face weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models import gemma3_text, llama

from .gguf_file import TensorInfo

Arrays = dict[str, mx.array]  # one tensor's arrays by suffix: weight (and scales, biases if packed)

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ATTENTION_MLP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}


class Metadata:
    """A file's metadata under its architecture's prefix (`llama.block_count`, ...)."""

    def __init__(self, metadata: dict[str, Any], arch: str, path: Path):
        self.raw, self.arch, self.path = metadata, arch, path

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(f"{self.arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file {self.path} lacks {self.arch}.{key}")
        return value

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.raw


@dataclass(frozen=True)
class Architecture:
    model_class: type
    model_args: Callable[[Metadata, dict[str, TensorInfo]], Any]
    per_layer: dict[str, str]  # blk.N.<gguf name> -> model.layers.N.<mlx-lm name>
    restore: Callable[[str, Arrays, Any], Arrays]  # (mlx-lm module path, arrays, args) -> HF's arrays


def _attention_shape(meta: Metadata) -> dict[str, int]:
    n_heads = int(meta.get("attention.head_count"))
    hidden = int(meta.get("embedding_length"))
    head_dim = int(meta.get("attention.key_length", hidden // n_heads))
    if int(meta.get("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"different key and value head sizes are not supported: {meta.path}")
    if int(meta.get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"partial rotary embeddings are not supported: {meta.path}")
    return dict(hidden_size=hidden, num_hidden_layers=int(meta.get("block_count")),
                intermediate_size=int(meta.get("feed_forward_length")), num_attention_heads=n_heads,
                num_key_value_heads=int(meta.get("attention.head_count_kv", n_heads)), head_dim=head_dim,
                rms_norm_eps=float(meta.get("attention.layer_norm_rms_epsilon")),
                max_position_embeddings=int(meta.get("context_length")))


def _linear_rope_scaling(meta: Metadata) -> dict | None:
    scaling = meta.get("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"unsupported rope scaling {scaling!r} in {meta.path}")
    return None if scaling == "none" else {"type": "linear", "factor": float(meta.get("rope.scaling.factor"))}


# ---------------------------------------------------------------- llama


def _llama_args(meta: Metadata, tensors: dict[str, TensorInfo]) -> llama.ModelArgs:
    if meta.get("expert_count", 0):
        raise ValueError(f"mixture-of-experts llama GGUF files are not supported: {meta.path}")
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"Llama 3 rope scaling (rope_freqs tensor) is not supported: {meta.path}")
    return llama.ModelArgs(
        model_type="llama",
        vocab_size=tensors["token_embd.weight"].shape[0],
        rope_theta=float(meta.get("rope.freq_base", 10000.0)),
        rope_scaling=_linear_rope_scaling(meta),
        attention_bias="blk.0.attn_q.bias" in tensors,
        tie_word_embeddings="output.weight" not in tensors,
        **_attention_shape(meta),
    )


def _unpermute(w: mx.array, n_heads: int) -> mx.array:
    # llama.cpp's converter turns each head's rows [first half; second half] (HF's rotate_half rope)
    # into interleaved pairs (GGML's rope). Rows are output features, so the same row order applies
    # to a packed quantized weight, its scales and biases, and a bias vector.
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_restore(name: str, arrays: Arrays, args: llama.ModelArgs) -> Arrays:
    heads = {"self_attn.q_proj": args.num_attention_heads, "self_attn.k_proj": args.num_key_value_heads}
    n = next((n for module, n in heads.items() if name.endswith(module)), None)
    return arrays if n is None else {k: _unpermute(v, n) for k, v in arrays.items()}


LLAMA = Architecture(llama.Model, _llama_args, {**_ATTENTION_MLP, "ffn_norm": "post_attention_layernorm"},
                     _llama_restore)

# ---------------------------------------------------------------- gemma3 (mlx-lm's gemma3_text)

# llama.cpp's gemma3 constants (llama-model.cpp): every 6th layer is global, the others slide with a
# rope base of 10k; only the 27B (62 layers) scales queries by hidden / heads instead of head_dim.
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62


def _gemma3_pattern(meta: Metadata) -> int:
    """Every N-th layer global, the rest sliding: N from attention.sliding_window_pattern (one bool per
    layer, True = sliding) where the file has it, else llama.cpp's 6."""
    if not meta.has("attention.sliding_window_pattern"):
        return _GEMMA3_PATTERN
    sliding = [bool(s) for s in meta.get("attention.sliding_window_pattern")]
    n = sliding.index(False) + 1 if False in sliding else len(sliding) + 1
    if sliding != [(i + 1) % n != 0 for i in range(len(sliding))]:
        raise ValueError(f"sliding-window layers {sliding} in {meta.path} are not every layer but each "
                         f"N-th, which mlx-lm's gemma3_text needs")
    return n


def _gemma3_args(meta: Metadata, tensors: dict[str, TensorInfo]) -> gemma3_text.ModelArgs:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if meta.has(key):
            raise ValueError(f"gemma3 GGUF with {key} is not supported (mlx-lm's gemma3_text has none): {meta.path}")
    shape = _attention_shape(meta)
    layers, heads = shape["num_hidden_layers"], shape["num_attention_heads"]
    scalar = shape["hidden_size"] // heads if layers == _GEMMA3_27B_LAYERS else shape["head_dim"]
    return gemma3_text.ModelArgs(
        model_type="gemma3_text",
        vocab_size=tensors["token_embd.weight"].shape[0],
        rope_theta=float(meta.get("rope.freq_base", 1_000_000.0)),
        rope_local_base_freq=float(meta.get("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)),
        rope_scaling=_linear_rope_scaling(meta),  # global layers only, as in Gemma 3 and llama.cpp
        query_pre_attn_scalar=scalar,
        sliding_window=int(meta.get("attention.sliding_window")),
        sliding_window_pattern=_gemma3_pattern(meta),
        **shape,
    )


def _gemma3_restore(name: str, arrays: Arrays, args: gemma3_text.ModelArgs) -> Arrays:
    # Gemma's RMSNorm scales by (1 + w); llama.cpp's converter stores 1 + w, mlx-lm adds the 1 itself.
    if name.endswith("norm"):
        return {k: v - 1 for k, v in arrays.items()}
    return arrays


GEMMA3 = Architecture(gemma3_text.Model, _gemma3_args, {
    **_ATTENTION_MLP,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}, _gemma3_restore)

ARCHITECTURES = {"llama": LLAMA, "gemma3": GEMMA3}


def architecture(metadata: dict[str, Any], path: Path) -> tuple[Architecture, Metadata]:
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(repr(a) for a in sorted(ARCHITECTURES))
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path} (supported: {supported})")
    return ARCHITECTURES[arch], Metadata(metadata, arch, path)


def mlx_name(arch: Architecture, name: str, path: Path) -> str:
    """mlx-lm's module path for a GGUF tensor name, without the leaf (`weight`, `bias`)."""
    parts = name.split(".")
    if parts[-1] in ("weight", "bias"):
        if len(parts) == 2 and parts[0] in _TOP_LEVEL:
            return _TOP_LEVEL[parts[0]]
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in arch.per_layer:
            return f"model.layers.{parts[1]}.{arch.per_layer[parts[2]]}"
    raise ValueError(f"unexpected tensor {name!r} in GGUF file {path}")
