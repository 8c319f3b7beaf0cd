"""The page write (vLLM's reshape_and_cache) for attention layers that own pages, on CUDA and Metal,
from one source (sources/page_write.py, in the portable dialect of dialect.py).

It stores each new token's K/V at its slot in place, through the input pointers: MLX sees the
pools as arrays that never change, so no write can turn into a copy of a whole pool (which MLX's
scatter does whenever anything else still references the pool, e.g. the step in flight), and
step N+1 can be dispatched while step N runs. Its small `written` output is an input of every
reader of that layer's pages in the step: MLX orders kernels by the buffers they share (CUDA
graphs; Metal's barriers between dependent dispatches), so this keeps a read after the write.
Where it runs is selector.PAGES_IN_PLACE (CUDA); elsewhere MLX's scatter writes the pages.

Quantized layers (runner/kv_quant.py) hold the values mlx-lm's QuantizedKVCache holds (mx.quantize's).
reshape_and_cache_quantizing quantizes the step's rows itself and writes the six parts in one launch, with
the arithmetic of MLX's GPU quantizer; where its load-time check (kernels/check.py) finds a part that
differs from mx.quantize's on the device, mx.quantize runs and reshape_and_cache_quantized copies its parts.
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

from pagedmlx.kernels import build
from pagedmlx.kernels.dialect import render
from pagedmlx.kernels.sources import page_write as src
from pagedmlx.core.kv.cache_dtype import KVQuant


def write_source(backend: str) -> str:
    return render(src.RESHAPE_AND_CACHE, backend)


@functools.lru_cache(maxsize=None)
def _write_kernel(backend: str):
    return build.make_kernel(backend, "pagedmlx_reshape_and_cache",
                             ["keys", "values", "slot_mapping", "k_pages", "v_pages"], ["written"],
                             write_source(backend), "")


@functools.lru_cache(maxsize=None)
def _quant_write_kernel(backend: str):
    return build.make_kernel(backend, "pagedmlx_reshape_and_cache_quant",
                             ["k_q", "k_s", "k_b", "v_q", "v_s", "v_b", "slot_mapping", "k_pages", "k_scales",
                              "k_biases", "v_pages", "v_scales", "v_biases"], ["written"],
                             render(src.RESHAPE_AND_CACHE_QUANT, backend), "")


@functools.lru_cache(maxsize=None)
def _quantizing_write_kernel(backend: str):
    return build.make_kernel(backend, "pagedmlx_reshape_and_cache_quantizing",
                             ["keys", "values", "slot_mapping", "k_pages", "k_scales", "k_biases", "v_pages",
                              "v_scales", "v_biases"], ["written"], render(src.RESHAPE_AND_CACHE_QUANTIZING, backend),
                             "")


def reshape_and_cache_quantizing(keys: mx.array, values: mx.array, k_pages: tuple[mx.array, mx.array, mx.array],
                                 v_pages: tuple[mx.array, mx.array, mx.array], slot_mapping: mx.array, quant: KVQuant,
                                 backend: Optional[str] = None) -> mx.array:
    """reshape_and_cache for quantized pages from the step's unquantized keys (T, n_kv, 1, Dk) and values
    (T, n_kv, 1, Dv): each row quantized as MLX's GPU mx.quantize does (in the pages' scales' dtype) and its
    packed words, scales and biases written in place at slot_mapping. Returns `written`, as reshape_and_cache."""
    T, n_kv, _, dk = keys.shape
    dv = values.shape[3]
    bits, group_size = quant.bits, quant.group_size
    if group_size % 32 or dk % group_size or dv % group_size or bits not in (4, 8):
        raise ValueError(f"the quantizing page write takes 4 or 8 bits in groups of a multiple of 32 channels "
                         f"dividing the head dims, not {bits} bits, group {group_size}, head dims {dk} / {dv}")
    template = [("KT", keys.dtype), ("S", k_pages[1].dtype), ("NKV", n_kv), ("DK", dk), ("DV", dv),
                ("GS", group_size), ("BITS", bits), ("BS", k_pages[0].shape[2])]
    warps = T * n_kv * (dk + dv) // group_size
    return _quantizing_write_kernel(backend or build.gpu_backend())(
        inputs=[keys, values, slot_mapping, *k_pages, *v_pages], template=template,
        grid=(max(warps * 32, 32), 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(4,)], output_dtypes=[mx.int32])[0][:1]


def reshape_and_cache_quantized(keys: tuple[mx.array, mx.array, mx.array],
                                values: tuple[mx.array, mx.array, mx.array],
                                k_pages: tuple[mx.array, mx.array, mx.array],
                                v_pages: tuple[mx.array, mx.array, mx.array],
                                slot_mapping: mx.array, backend: Optional[str] = None) -> mx.array:
    """reshape_and_cache for quantized pages: keys / values are mx.quantize's (packed (T, n_kv, W) uint32,
    scales, biases (T, n_kv, G)) of the step's rows; k_pages / v_pages the layer's (packed, scales, biases)
    pages, written in place at slot_mapping. Returns `written`, as reshape_and_cache does."""
    T, n_kv, kw = keys[0].shape
    template = [("S", k_pages[1].dtype), ("NKV", n_kv), ("KW", kw), ("KG", keys[1].shape[2]),
                ("VW", values[0].shape[2]), ("VG", values[1].shape[2]), ("BS", k_pages[0].shape[2])]
    return _quant_write_kernel(backend or build.gpu_backend())(
        inputs=[*keys, *values, slot_mapping, *k_pages, *v_pages], template=template,
        grid=(max(T * n_kv * max(kw, values[0].shape[2]), 1), 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(4,)], output_dtypes=[mx.int32])[0][:1]


def reshape_and_cache(keys: mx.array, values: mx.array, k_pages: mx.array, v_pages: mx.array,
                      slot_mapping: mx.array, backend: Optional[str] = None) -> mx.array:
    """Write keys (T, n_kv, 1, Dk) and values (T, n_kv, 1, Dv) into the pages at slot_mapping (T,)
    int32 (block * block_size + offset; negative: skip), in place. Returns `written`, a (1,) int32
    zero that every reader of these pages in the step must take as an input (a view of a 4-element
    output: see build.device_constant)."""
    T, n_kv, _, dk = keys.shape
    dv = values.shape[3]
    bs = k_pages.shape[2]
    template = [("P", k_pages.dtype), ("KT", keys.dtype), ("NKV", n_kv), ("DK", dk), ("DV", dv), ("BS", bs)]
    return _write_kernel(backend or build.gpu_backend())(
        inputs=[keys, values, slot_mapping, k_pages, v_pages], template=template,
        grid=(max(T * n_kv * max(dk, dv), 1), 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(4,)], output_dtypes=[mx.int32])[0][:1]
