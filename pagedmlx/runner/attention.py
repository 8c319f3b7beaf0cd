"""Paged attention for token-major batches of stock mlx-lm models.

A step's T tokens enter the model as T rows of length 1. Each layer gets a PagedLayerCache whose
`offset` is the per-token positions (so RoPE rotates each row by its own position), whose
`update_and_fetch` writes the new K/V into that layer's pages, and which the patched
`scaled_dot_product_attention` recognises to attend over pages for the whole batch: single-token
rows (decodes) together, prefill segments causally over their cached prefix plus new tokens.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from pagedmlx.runner import paged_kernels
from pagedmlx.scheduler_output import SchedulerOutput


def _upload(host: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """Send a step's int32 index arrays to the device as ONE array, each then a view (slice) of it:
    every MLX array made from host memory is an allocation and a copy of its own, and a step has
    a dozen index arrays."""
    flat = [np.ascontiguousarray(a, np.int32).reshape(-1) for a in host.values()]
    # At least 4 int32s: MLX's CUDA allocator keeps arrays of <= 8 bytes in a shared managed pool
    # that kernels' own tiny outputs live in too.
    buf = mx.array(np.concatenate(flat + [np.zeros(4, np.int32)]))
    out, start = {}, 0
    for (name, a), part in zip(host.items(), flat):
        out[name] = buf[start:start + part.size].reshape(a.shape)
        start += part.size
    return out


@dataclass
class AttentionMetadata:
    """The step's index tensors, built once (one upload) and shared by every layer."""

    num_tokens: int
    num_decodes: int
    pages_in_place: bool  # reshape_and_cache writes the pages (CUDA); else MLX scatters into them
    input_ids: Optional[mx.array] = None  # (T,)
    positions: Optional[mx.array] = None  # (T,)
    logits_indices: Optional[mx.array] = None  # (S,) rows whose logits are sampled
    placeholder_rows: Optional[mx.array] = None  # (R,) rows whose input token comes from the previous step
    placeholder_src: Optional[mx.array] = None  # (R,) where in the previous step's sampled tokens
    slot_mapping: Optional[mx.array] = None  # (T,) block * block_size + offset of each new token (in place)
    write_blocks: Optional[mx.array] = None  # (T,) page of each new token (scatter)
    write_offsets: Optional[mx.array] = None  # (T,) slot inside that page (scatter)
    decode_block_table: Optional[mx.array] = None  # (Bd, nb)
    decode_mask: Optional[mx.array] = None  # (Bd, 1, 1, nb * block_size) keys that exist (gather path)
    decode_seq_lens: Optional[mx.array] = None  # (Bd,)
    num_prefill_tokens: int = 0
    prefill_block_table: Optional[mx.array] = None  # (P, nb)
    prefill_query_rows: Optional[mx.array] = None  # (P * Lmax,) flat row of each padded query slot
    prefill_mask: Optional[mx.array] = None  # (P, 1, Lmax, nb * block_size) causal over prefix + new tokens
    prefill_out_rows: Optional[mx.array] = None  # (Tp,) padded slot of each real prefill token
    prefill_query_pos: Optional[mx.array] = None  # (P, Lmax) position of each padded query slot
    prefill_max_query_len: int = 0
    use_decode_kernel: bool = False
    decode_splits: int = 1
    decode_split_tokens: Optional[mx.array] = None  # (1,)

    @classmethod
    def build(cls, so: SchedulerOutput, block_size: int, decode_kernel_kv_heads: int = 0,
              pages_in_place: bool = False) -> "AttentionMetadata":
        """decode_kernel_kv_heads > 0: decode rows attend through the paged-decode kernel (split for
        that many kv heads); pages_in_place: the page-write kernel writes the pages."""
        T, nd = so.total_num_scheduled_tokens, so.num_decodes
        in_place = pages_in_place
        use_kernel = decode_kernel_kv_heads > 0 and nd > 0
        host = dict(input_ids=so.input_ids, positions=so.positions, logits_indices=so.logits_indices)
        if len(so.placeholder_rows):
            host.update(placeholder_rows=so.placeholder_rows, placeholder_src=so.placeholder_src)
        if in_place:
            host.update(slot_mapping=so.slot_mapping)
        else:
            host.update(write_blocks=so.slot_mapping // block_size, write_offsets=so.slot_mapping % block_size)
        splits = 1
        if nd:
            seq_lens = so.seq_lens[:nd]
            nb = -(-int(seq_lens.max()) // block_size)
            host.update(decode_block_table=so.block_table[:nd, :nb], decode_seq_lens=seq_lens)
            if use_kernel:
                splits, tokens = paged_kernels.num_splits(nd, decode_kernel_kv_heads, int(seq_lens.max()))
                host.update(decode_split_tokens=np.array([tokens]))
        if T > nd:
            host.update(_prefill_indices(so, block_size))
        md = cls(num_tokens=T, num_decodes=nd, pages_in_place=in_place, num_prefill_tokens=T - nd,
                 use_decode_kernel=use_kernel, decode_splits=splits, **_upload(host))
        if nd and not use_kernel:
            md.decode_mask = length_mask(md.decode_seq_lens, md.decode_block_table.shape[1] * block_size)
        if T > nd:
            # Causal over the gathered keys, built on the device from the queries' positions.
            num_keys = md.prefill_block_table.shape[1] * block_size
            md.prefill_mask = (mx.arange(num_keys)[None, None, :] <= md.prefill_query_pos[:, :, None])[:, None]
            md.prefill_max_query_len = md.prefill_query_pos.shape[1]
        return md


def _prefill_indices(so: SchedulerOutput, block_size: int) -> dict[str, np.ndarray]:
    """Prefill segments padded to the longest: block table, query row of each padded slot, padded
    slot of each real token, position of each padded slot's query."""
    nd = so.num_decodes
    qsl = so.query_start_loc[nd:]
    q_lens = np.diff(qsl)
    seq_lens = so.seq_lens[nd:]
    L = int(q_lens.max())
    nb = -(-int(seq_lens.max()) // block_size)
    j = np.arange(L)
    valid_q = j[None, :] < q_lens[:, None]  # (P, L)
    rows = np.where(valid_q, qsl[:-1, None] + j[None, :], 0)
    # Query j of a segment sits at position (seq_len - q_len + j) and sees keys up to it; a padded
    # query sits at 0 and so sees one key, which keeps its softmax finite.
    q_pos = np.where(valid_q, (seq_lens - q_lens)[:, None] + j[None, :], 0)
    return dict(prefill_block_table=so.block_table[nd:, :nb], prefill_query_rows=rows.reshape(-1),
                prefill_out_rows=np.flatnonzero(valid_q.reshape(-1)), prefill_query_pos=q_pos)


class KVPool:
    """Every layer's pages: keys and values each [num_blocks, n_kv_heads, block_size, head_dim]
    (head-major inside a page, so that gathered pages are already in attention's layout).

    The arrays live only in these lists: where MLX scatters the new K/V (no CUDA kernel), a second
    Python reference would turn each page write into a copy of the whole pool.
    """

    def __init__(self, num_blocks: int, block_size: int, layer_specs: list[tuple[int, int, int, mx.Dtype]]):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.keys = [mx.zeros((num_blocks, h, block_size, dk), dt) for h, dk, _, dt in layer_specs]
        self.values = [mx.zeros((num_blocks, h, block_size, dv), dt) for h, _, dv, dt in layer_specs]
        mx.eval(self.keys, self.values)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)


class PagedLayerCache:
    """Stands in for mlx-lm's KVCache in one layer for one step."""

    def __init__(self, layer: int, pool: KVPool, md: AttentionMetadata):
        self.layer = layer
        self.pool = pool
        self.md = md
        self.written: Optional[mx.array] = None  # reshape_and_cache's output: readers of the pages wait on it

    @property
    def offset(self) -> mx.array:
        return self.md.positions

    def make_mask(self, *args, **kwargs) -> None:
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        md, i = self.md, self.layer
        k_pages, v_pages = self.pool.keys, self.pool.values
        if md.pages_in_place:
            self.written = paged_kernels.reshape_and_cache(keys, values, k_pages[i], v_pages[i], md.slot_mapping)
            return keys, values
        # (T, n_kv, 1, D) -> (T, n_kv, D), scattered into the pages (in place when nothing else holds them).
        k_pages[i][md.write_blocks, :, md.write_offsets] = as_dtype(keys[:, :, 0, :], k_pages[i].dtype)
        v_pages[i][md.write_blocks, :, md.write_offsets] = as_dtype(values[:, :, 0, :], v_pages[i].dtype)
        return keys, values

    def attention(self, queries: mx.array, scale: float, window: Optional[int] = None,
                  sinks: Optional[mx.array] = None) -> mx.array:
        """queries (T, n_heads, 1, D) -> (T, n_heads, 1, Dv), attending over pages."""
        return paged_attention(queries, self.pool.keys[self.layer], self.pool.values[self.layer], self.md, scale,
                               self.written, window, sinks)


def length_mask(seq_lens: mx.array, num_keys: int, window: Optional[int] = None) -> mx.array:
    """(B, 1, 1, num_keys): which of each sequence's gathered keys exist (and, under a sliding
    window, are among its last `window`: the decode query sits at position seq_len - 1)."""
    pos = mx.arange(num_keys)[None, :]
    keep = pos < seq_lens[:, None]
    if window:
        keep = keep & (pos >= seq_lens[:, None] - window)
    return keep[:, None, None, :]


def as_dtype(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """Cast only when needed: every op in a layer is a kernel launch per step."""
    return x if x.dtype == dtype else x.astype(dtype)


def _gather(pages: mx.array, block_table: mx.array) -> mx.array:
    """(num_blocks, h, bs, d) through a (B, nb) block table -> (B, h, nb * bs, d), contiguous."""
    B, nb = block_table.shape
    _, h, bs, d = pages.shape
    return pages[block_table].transpose(0, 2, 1, 3, 4).reshape(B, h, nb * bs, d)


def paged_attention(queries: mx.array, k_pages: mx.array, v_pages: mx.array, md: AttentionMetadata, scale: float,
                    written: Optional[mx.array] = None, window: Optional[int] = None,
                    sinks: Optional[mx.array] = None) -> mx.array:
    """written: reshape_and_cache's output when the pages were written in place this step; every
    read of the pages below takes it as an input, which orders the read after the write.
    window: decode rows attend only their last `window` keys; sinks: (n_heads,) logits that join
    each head's softmax denominator (as SDPA's `sinks=`)."""
    outs = []
    nd = md.num_decodes
    if nd and md.use_decode_kernel and paged_kernels.supports(
            queries.shape[3], queries.shape[1], k_pages.shape[1], k_pages.dtype):
        q = queries.reshape(md.num_tokens, queries.shape[1], queries.shape[3])  # a view: no copy
        o = paged_kernels.paged_decode(q[:nd] if nd < md.num_tokens else q, k_pages, v_pages, md.decode_block_table,
                                       md.decode_seq_lens, scale, md.decode_splits, md.decode_split_tokens, written,
                                       window=window, sinks=sinks)
        outs.append(as_dtype(o[:, :, None, :], queries.dtype))
    elif nd:
        num_keys = md.decode_block_table.shape[1] * k_pages.shape[2]
        if md.decode_mask is None:  # this layer's shape is not one the kernel takes
            md.decode_mask = length_mask(md.decode_seq_lens, num_keys)
        mask = md.decode_mask if not window else length_mask(md.decode_seq_lens, num_keys, window)
        q = queries[:nd] if nd < md.num_tokens else queries
        outs.append(as_dtype(gather_decode(q[:, :, 0, :], k_pages, v_pages, md.decode_block_table, scale, mask,
                                           sinks, written)[:, :, None, :], queries.dtype))
    if md.num_prefill_tokens:
        if window:
            raise NotImplementedError("a sliding window on prefill rows is not supported yet")
        P, L = md.prefill_block_table.shape[0], md.prefill_max_query_len
        H, D = queries.shape[1], queries.shape[3]
        q = queries[:, :, 0, :][md.prefill_query_rows].reshape(P, L, H, D).transpose(0, 2, 1, 3)
        table = md.prefill_block_table if written is None else md.prefill_block_table + written
        k = _gather(k_pages, table)
        v = _gather(v_pages, table)
        o = mx.fast.scaled_dot_product_attention(as_dtype(q, k.dtype), k, v, scale=scale, mask=md.prefill_mask,
                                                 sinks=sinks)
        o = o.transpose(0, 2, 1, 3).reshape(P * L, H, -1)[md.prefill_out_rows]
        outs.append(as_dtype(o[:, :, None, :], queries.dtype))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def gather_decode(q: mx.array, k_pages: mx.array, v_pages: mx.array, block_table: mx.array, scale: float,
                  mask: mx.array, sinks: Optional[mx.array] = None, written: Optional[mx.array] = None) -> mx.array:
    """The portable decode path, and the kernels' reference: gather each sequence's pages into a
    contiguous copy, then SDPA (GQA native). q (B, H, D) -> (B, H, Dv) in the pages' dtype."""
    table = block_table if written is None else block_table + written
    k = _gather(k_pages, table)
    v = _gather(v_pages, table)
    if sinks is not None:
        sinks = as_dtype(sinks, k.dtype)
    return mx.fast.scaled_dot_product_attention(as_dtype(q, k.dtype)[:, :, None, :], k, v, scale=scale, mask=mask,
                                                sinks=sinks)[:, :, 0, :]


# ---- routing mlx-lm's attention call to the pages --------------------------------------------

_SDPA_NAME = "scaled_dot_product_attention"


def _make_dispatch(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kwargs):
        if isinstance(cache, PagedLayerCache):
            return cache.attention(queries, scale, sinks=sinks)
        if hasattr(cache, "record_queries"):  # the runner's shape probe
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
