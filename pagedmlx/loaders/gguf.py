"""Load GGUF files (llama.cpp's format) as mlx-lm models (llama, gemma3: gguf_arch.py) plus a tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .gguf_arch import Architecture, architecture, mlx_name
from .gguf_file import GROUP_SIZE, GGUFFile
from .gguf_tokenizer import build_tokenizer


def _on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def _bits(arrays: dict[str, mx.array]) -> int:
    return arrays["weight"].shape[-1] * 32 // (arrays["scales"].shape[-1] * GROUP_SIZE)


def _dequantize(arrays: dict[str, mx.array]) -> mx.array:
    return mx.dequantize(arrays["weight"], arrays["scales"].astype(mx.float32), arrays["biases"].astype(mx.float32),
                         group_size=GROUP_SIZE, bits=_bits(arrays))


def _read_weights(f: GGUFFile, arch: Architecture, args: Any,
                  quantized: bool) -> tuple[dict[str, mx.array], dict[str, int]]:
    """mlx-lm's weights by name, and the bits of each module kept packed."""
    weights, packed = {}, {}
    for name, info in f.tensors.items():
        module, leaf = mlx_name(arch, name, f.path), name.rsplit(".", 1)[1]
        arrays = arch.restore(module, f.load(info), args)
        if "scales" in arrays and quantized:
            packed[module] = _bits(arrays)
            weights.update({f"{module}.{k}": v for k, v in arrays.items()})
        else:
            weights[f"{module}.{leaf}"] = _dequantize(arrays) if "scales" in arrays else arrays["weight"]
    return weights, packed


def load_gguf(
    path: str | Path, dtype: mx.Dtype | None = None, quantized: bool | None = None
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a GGUF file as mlx-lm's model for its architecture (llama, gemma3) and its tokenizer.

    quantized: keep Q4_0/Q4_1/Q8_0 weights packed (default: on a GPU backend); otherwise they are
    dequantized, since MLX's CPU quantized matmuls are very slow. Other quantized types are always
    dequantized. dtype: for every floating-point array (default float16 when kept quantized, else float32).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    f = GGUFFile(path)
    arch, meta = architecture(f.metadata, path)
    if "token_embd.weight" not in f.tensors:
        raise ValueError(f"GGUF file {path} has no token_embd.weight")
    args = arch.model_args(meta, f.tensors)
    quantized = _on_gpu() if quantized is None else quantized
    dtype = dtype or (mx.float16 if quantized else mx.float32)
    weights, packed = _read_weights(f, arch, args, quantized)
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}

    model = arch.model_class(args)
    weights = model.sanitize(weights)
    if packed:
        nn.quantize(model, class_predicate=lambda p, _: p in packed and {"group_size": GROUP_SIZE, "bits": packed[p]})
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"GGUF file {path} does not match mlx-lm's {args.model_type} model: {e}") from e
    model.eval()
    mx.eval(model.parameters())
    return model, build_tokenizer(f.metadata)
