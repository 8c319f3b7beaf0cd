"""Paged attention for token-major batches of stock mlx-lm models.

A step's T tokens enter the model as T rows of length 1. Each layer gets a PagedLayerCache whose
`offset` is the per-token positions (so RoPE rotates each row by its own position), whose
`update_and_fetch` writes the new K/V into that layer's pages, and which the patched
`scaled_dot_product_attention` recognises to attend over pages for the whole batch: single-token
rows (decodes) together, prefill segments causally over their cached prefix plus new tokens, in
groups of one padded shape (one attention call each).

Layers of one KV cache group share block ids, so the step's index tensors are built once per group
(attention_metadata.py). A sliding-window group's decode and prefill read only the pages of the
window; learned attention sinks (gpt-oss) join the softmax's denominator wherever attention is computed.
"""

from __future__ import annotations

import itertools
import sys
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from pagedmlx.kernels import decode_attention, decode_attention_quant, page_write, prefill_attention
from pagedmlx.core.kv.cache_dtype import KVQuant
from pagedmlx.runner.attention_metadata import AttentionMetadata, PrefillGroup, page_rows
from pagedmlx.runner.kv_quant import (QuantizedPages, make_pages, read_pages, rotate_kv, rotate_queries,
                                      write_quantized, write_quantized_in_place)
from pagedmlx.runner.masks import length_mask

def as_dtype(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """Cast only when needed: every op in a layer is a kernel launch per step."""
    return x if x.dtype == dtype else x.astype(dtype)


def _gather(pages: mx.array, block_table: mx.array) -> mx.array:
    """(num_blocks, h, bs, d) through a (B, nb) block table -> (B, h, nb * bs, d), contiguous."""
    return _gather_rows(pages, page_rows(block_table, pages.shape[1]), block_table.shape[1])


def _gather_kv(k_pages: mx.array, v_pages: mx.array, block_table: mx.array) -> tuple[mx.array, mx.array]:
    """_gather of the keys and the values, through one row index."""
    rows = page_rows(block_table, k_pages.shape[1])
    nb = block_table.shape[1]
    return _gather_rows(k_pages, rows, nb), _gather_rows(v_pages, rows, nb)


def _gather_rows(pages, rows: mx.array, nb: int) -> mx.array:
    """pages: an array, or QuantizedPages (gathered, then dequantized)."""
    if isinstance(pages, QuantizedPages):
        return pages.gather_rows(rows, nb)
    P, h, bs, d = pages.shape
    return pages.reshape(P * h, bs * d)[rows].reshape(rows.shape[0], h, nb * bs, d)


_POOL_SERIALS = itertools.count()


class KVPool:
    """Every layer's pages, by layer index: keys and values each [num_blocks, n_kv_heads,
    block_size, head_dim] in the number of blocks of the layer's group (head-major inside a page,
    so that gathered pages are already in attention's layout); None for a layer that owns none.
    A quantized layer (quant[i] not None, kv_quant.py) holds packed values there, and its scales and
    biases in k_scales / k_biases / v_scales / v_biases.

    The arrays live only in these lists: where MLX scatters the new K/V (no CUDA kernel), a second
    Python reference would turn each page write into a copy of the whole pool.
    """

    def __init__(self, block_size: int, layers: list[tuple[int, tuple[int, int, int, mx.Dtype]]],
                 num_layers: int, quant: Optional[dict[int, KVQuant]] = None, quantize_in_write: bool = False):
        """layers: (number of blocks, (n_kv_heads, k_dim, v_dim, dtype)) of every layer that owns pages;
        quant: the quantized layers' KVQuant; quantize_in_write: the in-place page write of those layers
        quantizes the rows itself (KernelPlan.quantize_in_write)."""
        self.block_size = block_size
        self.serial = next(_POOL_SERIALS)  # names this pool for good (an id() is reused once a pool is freed)
        self.quantize_in_write = quantize_in_write
        self.quant: list[Optional[KVQuant]] = [(quant or {}).get(i) for i in range(num_layers)]
        self.keys: list[Optional[mx.array]] = [None] * num_layers
        self.values: list[Optional[mx.array]] = [None] * num_layers
        self.k_scales: list[Optional[mx.array]] = [None] * num_layers
        self.k_biases: list[Optional[mx.array]] = [None] * num_layers
        self.v_scales: list[Optional[mx.array]] = [None] * num_layers
        self.v_biases: list[Optional[mx.array]] = [None] * num_layers
        for i, (num_blocks, (h, dk, dv, dt)) in layers:
            q = self.quant[i]
            if q is None:
                self.keys[i] = mx.zeros((num_blocks, h, block_size, dk), dt)
                self.values[i] = mx.zeros((num_blocks, h, block_size, dv), dt)
            else:
                self.keys[i], self.k_scales[i], self.k_biases[i] = make_pages(num_blocks, h, block_size, dk, dt, q)
                self.values[i], self.v_scales[i], self.v_biases[i] = make_pages(num_blocks, h, block_size, dv, dt, q)
        mx.async_eval(self.arrays)  # zeroed on MLX's stream while the engine finishes starting

    @property
    def arrays(self) -> list[mx.array]:
        return [a for side in (self.keys, self.values, self.k_scales, self.k_biases, self.v_scales, self.v_biases)
                for a in side if a is not None]

    def reset(self) -> None:
        """Every page zeroed, in the same lists (their contents are lost: see ModelRunner.repair_pages)."""
        zero_in_place([self.keys, self.values, self.k_scales, self.k_biases, self.v_scales, self.v_biases])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def zero_in_place(lists: list[list]) -> None:
    """Each array in `lists` replaced by zeros of its shape and dtype, one at a time: the old one (possibly
    a graph whose evaluation failed) is dropped before its replacement is made, so memory never doubles."""
    for side in lists:
        for i, a in enumerate(side):
            if a is not None:
                side[i] = None
                side[i] = mx.zeros(a.shape, a.dtype)
                del a
                mx.eval(side[i])


class PagedLayerCache:
    """Stands in for mlx-lm's KVCache in one layer for one step. A shared layer's cache (`source`:
    the cache of the layer whose K/V it reads) writes nothing and reads its source's pages."""

    def __init__(self, layer: int, pool: KVPool, md: AttentionMetadata,
                 source: Optional["PagedLayerCache"] = None):
        self.layer = layer if source is None else source.layer
        self.pool = pool
        self.md = md
        self.source = source
        self.written: Optional[mx.array] = None  # reshape_and_cache's output: readers of the pages wait on it
        self.asked_window: Optional[int] = None
        self._new: tuple = (None, None)

    @property
    def offset(self) -> mx.array:
        return self.md.positions

    def make_mask(self, *args, window_size: Optional[int] = None, **kwargs) -> None:
        self.asked_window = window_size or self.asked_window  # checked against the plan at load
        return None

    def keys_and_values(self) -> tuple:  # gemma3n's shared layers ask their source's cache for these
        return self._new

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.source is not None:
            return keys, values
        md, i = self.md, self.layer
        k_pages, v_pages = self.pool.keys, self.pool.values
        self._new = (keys, values)
        if (quant := self.pool.quant[i]) is not None:
            if quant.rotate:
                keys, values = rotate_kv(keys), rotate_kv(values)
            if md.pages_in_place:
                self.written = write_quantized_in_place(self.pool, i, keys, values, md.slot_mapping, md.backend)
            else:
                write_quantized(self.pool, i, keys, values, md.write_index(keys.shape[1]))
            return self._new
        if md.pages_in_place:
            self.written = page_write.reshape_and_cache(keys, values, k_pages[i], v_pages[i], md.slot_mapping,
                                                        md.backend)
            return keys, values
        # (T, n_kv, 1, D) -> (T, n_kv, D), scattered into the pages (in place when nothing else holds them).
        index = md.write_index(k_pages[i].shape[1])
        k_pages[i][index] = as_dtype(keys[:, :, 0, :], k_pages[i].dtype)
        v_pages[i][index] = as_dtype(values[:, :, 0, :], v_pages[i].dtype)
        return keys, values

    def attention(self, queries: mx.array, scale: float, sinks: Optional[mx.array] = None) -> mx.array:
        """queries (T, n_heads, 1, D) -> (T, n_heads, 1, Dv), attending over pages."""
        written = self.source.written if self.source is not None else self.written
        k_pages, v_pages = read_pages(self.pool, self.layer)
        quant = self.pool.quant[self.layer]
        if quant is not None and quant.rotate:  # pages of rotated keys and values (kv_quant.rotate_kv)
            out = paged_attention(rotate_queries(queries), k_pages, v_pages, self.md, scale, written, sinks)
            return rotate_queries(out)
        return paged_attention(queries, k_pages, v_pages, self.md, scale, written, sinks)


def paged_attention(queries: mx.array, k_pages: mx.array, v_pages: mx.array, md: AttentionMetadata,
                    scale: float, written: Optional[mx.array] = None, sinks: Optional[mx.array] = None) -> mx.array:
    """written: reshape_and_cache's output when the pages were written in place this step; every
    read of the pages below takes it as an input, which orders the read after the write."""
    outs = []
    if md.num_decodes:
        q = queries[:md.num_decodes] if md.num_decodes < md.num_tokens else queries
        outs.append(_decode_attention(q, k_pages, v_pages, md, scale, written, sinks))
    if md.num_prefill_tokens:
        outs.append(_prefill_attention(queries[md.num_decodes:], k_pages, v_pages, md, scale, written, sinks))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def _decode_attention(q, k_pages, v_pages, md: AttentionMetadata, scale, written, sinks) -> mx.array:
    nd, H, D = md.num_decodes, q.shape[1], q.shape[3]
    if md.use_decode_kernel and decode_kernel_takes(H, k_pages, v_pages, md.backend):
        o = paged_decode(q.reshape(nd, H, D), k_pages, v_pages, md.decode_block_table, md.decode_seq_lens, scale,
                         md.decode_splits, md.decode_split_tokens, written, window=md.window, sinks=sinks,
                         backend=md.backend)
        return as_dtype(o[:, :, None, :], q.dtype)
    if md.decode_mask is None:  # this layer's shape is not one the kernel takes
        md.decode_mask = length_mask(md.decode_seq_lens, md.decode_block_table.shape[1] * k_pages.shape[2], md.window)
    rows = md.decode_page_rows(k_pages.shape[1])
    if written is not None:  # zero: orders this read after the layer's page write
        rows = rows + written
    nb = md.decode_block_table.shape[1]
    k, v = _gather_rows(k_pages, rows, nb), _gather_rows(v_pages, rows, nb)
    o = mx.fast.scaled_dot_product_attention(as_dtype(q, k.dtype), k, v, scale=scale, mask=md.decode_mask,
                                             sinks=_sinks(sinks, k.dtype))
    return as_dtype(o, q.dtype)


def decode_kernel_takes(n_heads: int, k_pages, v_pages, backend: Optional[str]) -> bool:
    """The paged decode kernel of these pages (16-bit, or quantized) takes this layer: the one per-call gate."""
    _, n_kv, _, dk = k_pages.shape
    dv = v_pages.shape[-1]
    if isinstance(k_pages, QuantizedPages):
        return decode_attention_quant.refusal(dk, dv, n_heads, n_kv, k_pages.dtype, k_pages.quant, backend) is None
    return decode_attention.supports_layer(dk, dv, n_heads, n_kv, k_pages.dtype, backend)


def paged_decode(q: mx.array, k_pages, v_pages, *args, **kwargs) -> mx.array:
    """decode_attention.paged_decode, or its quantized kernel for QuantizedPages (same arguments)."""
    if isinstance(k_pages, QuantizedPages):
        return decode_attention_quant.paged_decode_quantized(q, k_pages, v_pages, *args, **kwargs)
    return decode_attention.paged_decode(q, k_pages, v_pages, *args, **kwargs)


def gather_decode(q: mx.array, k_pages: mx.array, v_pages: mx.array, block_table: mx.array, scale: float,
                  mask: mx.array, sinks: Optional[mx.array] = None, written: Optional[mx.array] = None) -> mx.array:
    """The portable decode path's math (_decode_attention runs it with the step's page rows), and the
    kernels' reference: gather each sequence's pages into a contiguous copy, then SDPA (GQA native).
    q (B, H, D) -> (B, H, Dv) in the pages' dtype."""
    table = block_table if written is None else block_table + written
    k, v = _gather_kv(k_pages, v_pages, table)
    return mx.fast.scaled_dot_product_attention(as_dtype(q, k.dtype)[:, :, None, :], k, v, scale=scale, mask=mask,
                                                sinks=_sinks(sinks, k.dtype))[:, :, 0, :]


def _sinks(sinks: Optional[mx.array], dtype: mx.Dtype) -> Optional[mx.array]:
    return None if sinks is None else as_dtype(sinks, dtype)


def _prefill_attention(q, k_pages, v_pages, md: AttentionMetadata, scale, written, sinks) -> mx.array:
    """q: the prefill rows (Tp, H, 1, D); the prefill kernel over all segments where it runs, else
    one attention call per prefill group (attention_metadata)."""
    rows = q[:, :, 0, :]
    if md.prefill_tiles is not None:  # 16-bit or quantized pages (prefill_attention.paged_prefill)
        t = md.prefill_tiles
        o = prefill_attention.paged_prefill(rows, k_pages, v_pages, t.block_table, t.segs, t.tiles, scale,
                                            t.splits, t.split_tokens, written, window=md.window, sinks=sinks)
        return as_dtype(o[:, :, None, :], q.dtype)
    outs = [_group_attention(rows, k_pages, v_pages, g, scale, written, sinks) for g in md.prefill_groups]
    o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    if md.prefill_order is not None:
        o = o[md.prefill_order]
    return as_dtype(o[:, :, None, :], q.dtype)


def _group_attention(rows: mx.array, k_pages: mx.array, v_pages: mx.array, g: PrefillGroup, scale: float,
                     written: Optional[mx.array], sinks: Optional[mx.array]) -> mx.array:
    """The prefill rows (Tp, H, D) -> the group's real queries' outputs (n, H, Dv), segment by segment.
    The queries are gathered (a fresh array: the same strides whatever the batch, so on CUDA one
    cuDNN graph per shape), each segment's keys gathered from its pages."""
    P, Lq, H, D = g.block_table.shape[0], g.num_queries, rows.shape[1], rows.shape[2]
    q = rows[g.query_rows].reshape(P, Lq, H, D).transpose(0, 2, 1, 3)
    rows_index = g.page_rows(k_pages.shape[1])
    if written is not None:  # zero: orders this read after the layer's page write
        rows_index = rows_index + written
    nb = g.block_table.shape[1]
    k, v = _gather_rows(k_pages, rows_index, nb), _gather_rows(v_pages, rows_index, nb)
    if k.shape[2] != g.num_keys:
        k, v = k[:, :, :g.num_keys], v[:, :, :g.num_keys]
    o = mx.fast.scaled_dot_product_attention(as_dtype(q, k.dtype), k, v, scale=scale, mask=g.mask,
                                             sinks=_sinks(sinks, k.dtype))
    return o.transpose(0, 2, 1, 3).reshape(P * Lq, H, -1)[g.out_rows]


def warm_up_prefill(n_heads: int, k_pages: mx.array, v_pages: mx.array, has_sinks: bool,
                    groups: list[PrefillGroup]) -> None:
    """Run each group's attention once on page 0 with zero queries: on CUDA, MLX builds and keeps
    the cuDNN graph of each shape (chunked_prefill_groups), so that later prompts find them."""
    sinks = mx.zeros((n_heads,), k_pages.dtype) if has_sinks else None
    for g in groups:
        rows = mx.zeros((g.num_queries, n_heads, k_pages.shape[-1]), k_pages.dtype)
        mx.eval(_group_attention(rows, k_pages, v_pages, g, 1.0, None, sinks))


# ---- routing mlx-lm's attention call to the pages --------------------------------------------

_SDPA_NAME = "scaled_dot_product_attention"


def _make_dispatch(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kwargs):
        if isinstance(cache, PagedLayerCache):
            return cache.attention(queries, scale, sinks)
        if hasattr(cache, "record_queries"):  # the layer plan's probe
            cache.record_queries(queries, sinks)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kwargs)

    scaled_dot_product_attention._pagedmlx_original = original
    return scaled_dot_product_attention


def install_paged_attention(model: nn.Module) -> int:
    """Rebind `scaled_dot_product_attention` in the modules that define the model's layers.

    The dispatcher calls the original for any other cache, so mlx-lm keeps working unchanged in
    the same process. Returns how many modules were patched (0 means the model computes attention
    some other way and cannot run on pages).
    """
    patched = 0
    module_names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    for name in module_names:
        module = sys.modules.get(name)
        fn = getattr(module, _SDPA_NAME, None)
        if fn is None or not callable(fn):
            continue
        if not hasattr(fn, "_pagedmlx_original"):
            setattr(module, _SDPA_NAME, _make_dispatch(fn))
        patched += 1
    return patched
