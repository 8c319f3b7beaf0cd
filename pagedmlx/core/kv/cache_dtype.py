"""kv_cache_dtype (vLLM's option): what the KV pages hold. No MLX import here (config.py uses it).

"auto": the model's dtype. "int8" / "int4": affine quantization as mlx-lm's QuantizedKVCache and
`mx.quantize` (per group of `group_size` channels of a head: a scale and a bias in the model's dtype,
values packed into uint32). MLX 0.32 also has `mx.to_fp8` (e4m3 per element, no scale) and the
mxfp8 / mxfp4 / nvfp4 modes of `mx.quantize`; pagedmlx does not page them (docs/kv-quantization.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

KV_CACHE_DTYPES = ("auto", "int8", "int4")
_ALIASES = {"q8": "int8", "8": "int8", "8bit": "int8", "q4": "int4", "4": "int4", "4bit": "int4"}
_NOT_SERVED = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
GROUP_SIZES = (32, 64, 128)


def normalize_kv_cache_dtype(value: object) -> str:
    """The canonical name of a kv_cache_dtype, or a ValueError naming the field, value and choices."""
    text = str(value).strip().lower() if value is not None else "auto"
    text = _ALIASES.get(text, text)
    if text in KV_CACHE_DTYPES:
        return text
    extra = (" (MLX 0.32 has fp8 casts, mx.to_fp8, but pagedmlx pages affine int8/int4 only)"
             if text in _NOT_SERVED else "")
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}{extra}")


@dataclass(frozen=True)
class KVQuant:
    """Affine quantization of one layer's pages: `bits` per value, a scale and a bias per `group_size`."""

    bits: int
    group_size: int
    rotate: bool = False  # kv_cache_rotate: each head's keys and values rotated by a Hadamard matrix first

    def packed_dim(self, dim: int) -> int:
        """uint32 words of one head's `dim` values."""
        return dim * self.bits // 32

    def bytes_per_head_token(self, dim: int, scale_bytes: int) -> int:
        """Bytes of one head's `dim` values of one token: packed values plus a scale and a bias per group."""
        return 4 * self.packed_dim(dim) + 2 * (dim // self.group_size) * scale_bytes


def default_group_size(bits: int, head_dim: int) -> int:
    """8-bit: the whole head where it is 128 or 64 channels (a scale and bias per 64 channels would
    cost 6% of an int8 page: 1.88x of bf16, short of the 1.9x asked); 4-bit: 64 as mlx-lm's default."""
    wanted = (128, 64, 32) if bits == 8 else (64, 32)
    return next((g for g in wanted if head_dim % g == 0), 0)


def layer_quant(kv_cache_dtype: str, group_size: Optional[int], k_dim: int, v_dim: int,
                rotate: bool = False) -> Optional[KVQuant]:
    """The quantization of a layer with these head dims (None for "auto"); a ValueError if the group
    size does not divide both, or (rotate) if one is not a power of two (a Hadamard matrix's size)."""
    if kv_cache_dtype == "auto":
        return None
    if rotate and any(d & (d - 1) for d in (k_dim, v_dim)):
        raise ValueError(f"kv_cache_rotate: a layer's head dims {k_dim}/{v_dim} are not both powers of two (the "
                         "Hadamard rotation's sizes); use kv_cache_rotate False")
    bits = 8 if kv_cache_dtype == "int8" else 4
    g = group_size or min(default_group_size(bits, k_dim), default_group_size(bits, v_dim))
    if not g or k_dim % g or v_dim % g:
        what = f"kv_cache_group_size {group_size}" if group_size else f"no group size of {GROUP_SIZES}"
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: {what} divides the head dims {k_dim}/{v_dim} of a "
                         "layer (mx.quantize takes groups of 32, 64 or 128 channels); use kv_cache_dtype 'auto'")
    return KVQuant(bits, g, rotate)


def bytes_per_token(n_kv: int, k_dim: int, v_dim: int, dtype_size: int, quant: Optional[KVQuant]) -> int:
    """One token's keys and values in one layer."""
    if quant is None:
        return n_kv * (k_dim + v_dim) * dtype_size
    return n_kv * (quant.bytes_per_head_token(k_dim, dtype_size) + quant.bytes_per_head_token(v_dim, dtype_size))
