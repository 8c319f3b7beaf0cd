"""Load llama-architecture GGUF files (llama.cpp's format) into mlx-lm's llama Model plus a tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .gguf_tokenizer import build_tokenizer

# GGUF's quantized block types that MLX reads (Q4_0, Q4_1, Q8_0) all use 32 values per block.
_GROUP_SIZE = 32

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# mx.load names a quantized tensor X.weight as X.weight (packed), X.scales and X.biases.
_SUFFIXES = ("weight", "scales", "biases", "bias")


def _plain(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _read(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        weights, metadata = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}{_unsupported_types(path)}") from e
    return weights, {k: _plain(v) for k, v in metadata.items()}


def _unsupported_types(path: Path) -> str:
    """Name the tensor types MLX cannot read (it drops or rejects them without saying which)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return ""
    try:
        types = {t.tensor_type.name for t in GGUFReader(path).tensors}
    except Exception:  # a damaged file: MLX's own message is all there is
        return ""
    readable = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q4_K", "Q6_K"}
    bad = sorted(types - readable)
    return f" (tensor types MLX cannot read: {', '.join(bad)})" if bad else ""


def model_args(metadata: dict[str, Any], weights: dict[str, mx.array], path: Path | str = "") -> ModelArgs:
    """mlx-lm llama ModelArgs from GGUF metadata; refuses what mlx-lm's llama cannot run exactly."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path} (only 'llama' is supported)")

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file {path} lacks llama.{key}")
        return value

    if get("expert_count", 0):
        raise ValueError(f"mixture-of-experts llama GGUF files are not supported: {path}")
    if "rope_freqs.weight" in weights:
        raise ValueError(f"Llama 3 rope scaling (rope_freqs tensor) is not supported: {path}")
    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // n_heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"partial rotary embeddings are not supported: {path}")
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"unsupported rope scaling {scaling!r} in {path}")
    return ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(get("block_count")),
        intermediate_size=int(get("feed_forward_length")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        vocab_size=weights["token_embd.weight"].shape[0],
        max_position_embeddings=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=None if scaling == "none" else {"type": "linear", "factor": float(get("rope.scaling.factor"))},
        attention_bias="blk.0.attn_q.bias" in weights,
        tie_word_embeddings="output.weight" not in weights,
    )


def _mlx_name(name: str, path: Path) -> str:
    parts = name.split(".")
    if parts[-1] in _SUFFIXES:
        if len(parts) == 2 and parts[0] in _TOP_LEVEL:
            return f"{_TOP_LEVEL[parts[0]]}.{parts[1]}"
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _PER_LAYER:
            return f"model.layers.{parts[1]}.{_PER_LAYER[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected tensor {name!r} in llama GGUF file {path}")


def _unpermute(w: mx.array, n_heads: int) -> mx.array:
    # llama.cpp's converter turns each head's rows [first half; second half] (HF's rotate_half rope)
    # into interleaved pairs (GGML's rope). Rows are output features, so the same row order applies
    # to a packed quantized weight, its scales and biases, and a bias vector.
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _bits(weights: dict[str, mx.array], prefix: str) -> int:
    packed, scales = weights[f"{prefix}.weight"], weights[f"{prefix}.scales"]
    return packed.shape[-1] * 32 // (scales.shape[-1] * _GROUP_SIZE)


def _on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def load_gguf(
    path: str | Path, dtype: mx.Dtype | None = None, quantized: bool | None = None
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a llama-architecture GGUF file as mlx-lm's llama Model and its tokenizer.

    quantized: keep Q4_0/Q4_1/Q8_0 weights packed (default: on a GPU backend); otherwise they are
    dequantized, since MLX's CPU quantized matmuls are very slow. dtype: for every floating-point
    array (default float16 when kept quantized, else float32).
    """
    path = Path(path)
    raw, metadata = _read(path)
    if "token_embd.weight" not in raw:
        raise ValueError(f"GGUF file {path} has no token_embd.weight{_unsupported_types(path)}")
    args = model_args(metadata, raw, path)
    quantized = _on_gpu() if quantized is None else quantized
    dtype = dtype or (mx.float16 if quantized else mx.float32)

    weights = {_mlx_name(k, path): v for k, v in raw.items()}
    heads = {"q_proj": args.num_attention_heads, "k_proj": args.num_key_value_heads}
    for name, w in weights.items():
        if name.split(".")[-2] in heads:
            weights[name] = _unpermute(w, heads[name.split(".")[-2]])

    packed = {name[: -len(".scales")] for name in weights if name.endswith(".scales")}
    bits = {prefix: _bits(weights, prefix) for prefix in packed}
    if not quantized:
        for prefix in packed:
            scales, biases = weights.pop(f"{prefix}.scales"), weights.pop(f"{prefix}.biases")
            weights[f"{prefix}.weight"] = mx.dequantize(
                weights[f"{prefix}.weight"],
                scales.astype(mx.float32),
                biases.astype(mx.float32),
                group_size=_GROUP_SIZE,
                bits=bits[prefix],
            )
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}

    model = Model(args)
    if quantized and packed:
        nn.quantize(
            model,
            class_predicate=lambda p, _: {"group_size": _GROUP_SIZE, "bits": bits[p]} if p in packed else False,
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"GGUF file {path} does not match a llama model: {e}{_unsupported_types(path)}") from e
    model.eval()
    mx.eval(model.parameters())
    return model, build_tokenizer(metadata)
