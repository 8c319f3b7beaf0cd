"""Quantized KV pages (kv_cache_dtype int8 / int4): how a layer's pages hold values, scales and
biases, how new keys and values are written into them, and how a read dequantizes what it gathered.

A quantized layer's pages are three arrays per side, each [num_blocks, n_kv_heads, block_size, *]:
the values packed into uint32 (head_dim * bits / 32 words), and a scale and a bias per group of
channels in the model's dtype (head_dim / group_size each), as `mx.quantize` makes them and as
mlx-lm's QuantizedKVCache keeps them. Like the 16-bit pages they live only in KVPool's lists.

QuantizedPages is what attention reads in place of a 16-bit page array: it has the shape and dtype
of the pages it stands for, and gathers rows of its three parts then dequantizes, so the portable
gather paths run unchanged, and the quantized decode kernels (kernels/decode_attention_quant.py) read
its parts. Where pages are written in place (CUDA) the page-write kernel quantizes the rows and writes them
(write_quantized_in_place; where its check against mx.quantize failed at load, it copies mx.quantize's
parts); elsewhere MLX scatters mx.quantize's parts (write_quantized).
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx
import numpy as np

from pagedmlx.core.kv.cache_dtype import KVQuant


class QuantizedPages:
    """One side (keys or values) of a quantized layer's pages, for one step's reads."""

    def __init__(self, packed: mx.array, scales: mx.array, biases: mx.array, quant: KVQuant):
        self.packed, self.scales, self.biases, self.quant = packed, scales, biases, quant

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(num_blocks, n_kv_heads, block_size, head_dim): the shape of the pages it stands for."""
        P, h, bs, _ = self.scales.shape
        return (P, h, bs, self.scales.shape[-1] * self.quant.group_size)

    @property
    def dtype(self) -> mx.Dtype:
        return self.scales.dtype

    def gather_rows(self, rows: mx.array, nb: int) -> mx.array:
        """Pages (P, h, bs, *) flattened to rows of (P * h, bs * *), the rows taken (as attention's
        _gather_rows), then dequantized -> (B, h, nb * bs, head_dim) in the model's dtype."""
        parts = [_take(a, rows, nb) for a in (self.packed, self.scales, self.biases)]
        return mx.dequantize(*parts, group_size=self.quant.group_size, bits=self.quant.bits)


def _take(pages: mx.array, rows: mx.array, nb: int) -> mx.array:
    P, h, bs, d = pages.shape
    return pages.reshape(P * h, bs * d)[rows].reshape(rows.shape[0], h, nb * bs, d)


def make_pages(num_blocks: int, h: int, block_size: int, dim: int, dtype: mx.Dtype,
               quant: KVQuant) -> tuple[mx.array, mx.array, mx.array]:
    """Zeroed packed values, scales and biases for one side of one layer."""
    groups = dim // quant.group_size
    return (mx.zeros((num_blocks, h, block_size, quant.packed_dim(dim)), mx.uint32),
            mx.zeros((num_blocks, h, block_size, groups), dtype), mx.zeros((num_blocks, h, block_size, groups), dtype))


def quantize_rows(pool, i: int, keys: mx.array, values: mx.array) -> list[tuple[mx.array, mx.array, mx.array]]:
    """mx.quantize of the step's new keys and values (T, n_kv, 1, D) of layer i, in its scales' dtype:
    [(packed, scales, biases) of the keys, of the values], each (T, n_kv, *)."""
    quant = pool.quant[i]
    out = []
    for side, x in (("k", keys), ("v", values)):
        x = x[:, :, 0, :]
        dtype = getattr(pool, f"{side}_scales")[i].dtype
        out.append(tuple(mx.quantize(x if x.dtype == dtype else x.astype(dtype), group_size=quant.group_size,
                                     bits=quant.bits)))
    return out


def write_quantized(pool, i: int, keys: mx.array, values: mx.array, index: tuple) -> None:
    """Quantize the step's new keys and values (T, n_kv, 1, D) of layer i and scatter them into its
    pages at `index` (AttentionMetadata.write_index: page, head and slot, each (T, n_kv)), each part
    through the pool's own list (in place: no second reference)."""
    for side, parts in zip(("keys", "values"), quantize_rows(pool, i, keys, values)):
        for name, part in zip((side, f"{side[0]}_scales", f"{side[0]}_biases"), parts):
            getattr(pool, name)[i][index] = part


def write_quantized_in_place(pool, i: int, keys: mx.array, values: mx.array, slot_mapping: mx.array,
                             backend: Optional[str]) -> mx.array:
    """write_quantized through the page-write kernel (kernels/page_write.py), in place at slot_mapping;
    returns its `written`, which every reader of layer i's pages takes as an input. The kernel quantizes
    the rows itself where pool.quantize_in_write (its load-time check passed), else mx.quantize runs first."""
    from pagedmlx.kernels import page_write

    k_pages = (pool.keys[i], pool.k_scales[i], pool.k_biases[i])
    v_pages = (pool.values[i], pool.v_scales[i], pool.v_biases[i])
    if pool.quantize_in_write:
        return page_write.reshape_and_cache_quantizing(keys, values, k_pages, v_pages, slot_mapping, pool.quant[i],
                                                       backend)
    k_parts, v_parts = quantize_rows(pool, i, keys, values)
    return page_write.reshape_and_cache_quantized(k_parts, v_parts, k_pages, v_pages, slot_mapping, backend)


def read_pages(pool, i: int) -> tuple:
    """(keys, values) of layer i as attention reads them: arrays, or QuantizedPages."""
    quant: Optional[KVQuant] = pool.quant[i]
    if quant is None:
        return pool.keys[i], pool.values[i]
    return (QuantizedPages(pool.keys[i], pool.k_scales[i], pool.k_biases[i], quant),
            QuantizedPages(pool.values[i], pool.v_scales[i], pool.v_biases[i], quant))


# ---- kv_cache_rotate: a Hadamard rotation of each head before quantizing -------------------------------
# Pages hold k' = k H s and v' = v H s (H the d x d +-1 Sylvester matrix, H H = d I, s = 2^-floor(log2(d) / 2)
# keeping magnitudes); attention takes q' = q H / (d s) and its output o' = o H s comes back as o' H / (d s).
# Then q' . k' = q . k and o' H / (d s) = o: attention is unchanged up to rounding, while the quantization
# groups see the channels mixed (an outlier channel no longer sets its group's range). Every factor is a
# power of two, so each matrix is exact in any float dtype. Kernels and gathers read the pages unchanged.
# A product with the matrix, not mx.hadamard_transform (the same matrix, in the same ordering): a matmul runs
# on every MLX backend, and hadamard_transform could not be tried on the CUDA backend when this was written.
# Either is one launch; the product's d x d work per row is small next to attention's.

@functools.lru_cache(maxsize=None)
def _hadamard(d: int, scale: float, dtype: mx.Dtype) -> mx.array:
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return mx.array(h * scale, dtype=dtype)


def _s(d: int) -> float:
    return 2.0 ** -(d.bit_length() - 1 >> 1)


def rotate_kv(x: mx.array) -> mx.array:
    """Keys or values (..., d) as a rotated layer's pages hold them."""
    d = x.shape[-1]
    return x @ _hadamard(d, _s(d), x.dtype)


def rotate_queries(x: mx.array) -> mx.array:
    """Queries (..., d) for a rotated layer's keys; the same map takes its output back from rotated values."""
    d = x.shape[-1]
    return x @ _hadamard(d, 1.0 / (d * _s(d)), x.dtype)

