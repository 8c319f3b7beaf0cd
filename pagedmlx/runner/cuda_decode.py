"""Paged KV kernels for MLX's CUDA backend: the page write (reshape_and_cache) and paged-decode attention.

The page write stores each new token's K/V at its slot in place, through the input pointers: MLX
sees the pools as arrays that never change, so no write can turn into a copy of a whole pool
(which MLX's scatter does whenever anything else still references the pool, e.g. the step in
flight), and step N+1 can be dispatched while step N runs. Its small `written` output is an input
of every reader of that layer's pages in the step: MLX's CUDA graphs order nodes by the buffers
they share, so this is what keeps a read after the write.

The decode kernel reads K/V straight from the page pool through the block table: no gathered
copy. One thread block per (kv head, sequence, KV split) serves all G query heads that share the
kv head (each K/V byte is read once; HEADS_PER_BLOCK can split a group over blocks); inside it,
groups of lanes each take one token's row in 16-byte vectors, several tokens in flight per warp,
with an online softmax; groups and warps then merge their partials. Long contexts with few
sequences are split along the keys (split-KV) and merged by a second small kernel.

For bf16/fp16 (head_dim 64/128/256, up to 8 query heads per kv head) the default accumulation runs
on tensor cores instead (MMA): per 16-token tile a warp computes the G x 16 scores and the weighted
values with mma.sync, K/V staged in shared memory by cp.async. The lanes kernel above is bound by
its instruction count when a K/V byte serves several heads; the tensor cores take that work.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import mlx.core as mx

from pagedmlx.runner import cuda_mma_sources as mma_src
from pagedmlx.runner import cuda_sources as src

THREADS = 128  # 4 warps
UNROLL = 2  # token steps whose loads are issued together
PREFETCH = 1  # issue the next steps' loads before this step's math (best of the sweep on the H200, 2026-12-02)
# Settings swept on the H200 (docs/benchmarks.md, runs 13-14) that did not win broadly, kept for other GPUs:
VECTORS = 1  # 16-byte vectors per lane per token row; 2: half the lanes per token, twice the registers
HEADS_PER_BLOCK = 0  # query heads per thread block; 0: the kv head's whole group (each K/V byte read once)
# Tensor cores for QK and PV where supports_mma (bf16/fp16, head_dim 64/128/256, group <= 8): 32 x 4096
# keys 0.172 ms against 0.282 for the lanes kernel (H200, run 16); PAGEDMLX_DECODE_MMA=0 turns it off.
MMA = int(os.environ.get("PAGEDMLX_DECODE_MMA", "1"))
TARGET_BLOCKS = 1056  # ~8 thread blocks per SM of a 132-SM GPU: enough loads in flight to hide latency
MIN_SPLIT_TOKENS = 512  # 1 x 32k keys on the H200: 64 splits 0.120 ms, 128 splits 0.139 ms (2026-12-03)

# `written` (the page write's output) is not read: it only orders the kernel after the write.
_INPUTS = ["q", "k_pages", "v_pages", "block_table", "seq_lens", "split_tokens", "scale", "written"]


@functools.lru_cache(maxsize=None)
def _kernels(mma: bool = False):
    """(single, split, merge) kernels; mma: the tensor-core accumulation."""
    body, header, name = ((mma_src.ACCUMULATE_MMA, src.HEADER + mma_src.MMA_HEADER, "pagedmlx_decode_mma") if mma
                          else (src.ACCUMULATE, src.HEADER, "pagedmlx_decode"))
    single = mx.fast.cuda_kernel(name, _INPUTS, ["out"], body + src.MERGE_WARPS + src.WRITE_OUT, header=header)
    split = mx.fast.cuda_kernel(name + "_split", _INPUTS, ["part_acc", "part_m", "part_l"],
                                body + src.MERGE_WARPS + src.WRITE_SPLIT, header=header)
    merge = mx.fast.cuda_kernel("pagedmlx_decode_merge", ["part_acc", "part_m", "part_l"], ["out"], src.MERGE, header=src.HEADER)
    return single, split, merge


@functools.lru_cache(maxsize=None)
def _write_kernel():
    return mx.fast.cuda_kernel("pagedmlx_reshape_and_cache", ["keys", "values", "slot_mapping", "k_pages", "v_pages"],
                               ["written"], src.RESHAPE_AND_CACHE)


def reshape_and_cache(keys: mx.array, values: mx.array, k_pages: mx.array, v_pages: mx.array,
                      slot_mapping: mx.array) -> mx.array:
    """Write keys (T, n_kv, 1, Dk) and values (T, n_kv, 1, Dv) into the pages at slot_mapping (T,)
    int32 (block * block_size + offset; negative: skip), in place. Returns `written`, a (1,) int32
    zero that every reader of these pages in the step must take as an input (a view of a 4-element
    output: see _scale_array)."""
    T, n_kv, _, dk = keys.shape
    dv = values.shape[3]
    bs = k_pages.shape[2]
    template = [("P", k_pages.dtype), ("NKV", n_kv), ("DK", dk), ("DV", dv), ("BS", bs)]
    return _write_kernel()(inputs=[keys, values, slot_mapping, k_pages, v_pages], template=template,
                           grid=(max(T * n_kv * max(dk, dv), 1), 1, 1), threadgroup=(256, 1, 1),
                           output_shapes=[(4,)], output_dtypes=[mx.int32])[0][:1]


@functools.lru_cache(maxsize=None)
def _scale_array(scale: float) -> mx.array:
    """A device constant, made once: a host-made array per layer call would cost an upload each.
    Padded past 8 bytes: MLX's CUDA allocator pools arrays of <= 8 bytes in managed pages that
    the host writes small arrays into too."""
    return mx.full((4,), scale, mx.float32)


@functools.lru_cache(maxsize=None)
def _no_write() -> mx.array:
    return mx.zeros((4,), mx.int32)


def is_available() -> bool:
    try:
        return mx.default_device() == mx.gpu and mx.cuda.is_available()
    except AttributeError:
        return False


def lane_layout(head_dim: int, dtype: mx.Dtype, vectors: int = 1) -> Optional[tuple[int, int]]:
    """(lanes per token, elements per lane) such that each lane reads `vectors` whole 16-byte vectors."""
    tpt = min(32, head_dim * dtype.size // (16 * vectors))
    if tpt < 1 or 32 % tpt or head_dim % tpt or (head_dim // tpt) * dtype.size % 16:
        return None
    return tpt, head_dim // tpt


@functools.lru_cache(maxsize=None)
def kernel_layout(head_dim: int, group: int, dtype: mx.Dtype, vectors: int = VECTORS) -> Optional[tuple[int, int]]:
    """The lane layout the kernel runs with: `vectors` per lane where registers allow, else one.
    Registers: each lane keeps G x VEC query and accumulator values."""
    for v in (vectors, 1):
        layout = lane_layout(head_dim, dtype, v)
        if layout is not None and group * layout[1] <= 64:
            return layout
    return None


def supports_mma(head_dim: int, group: int, dtype: mx.Dtype) -> bool:
    """The tensor-core kernel: 16-bit floats, whole 64-element swizzle groups, heads fit 8 of 16 rows."""
    return dtype in (mx.float16, mx.bfloat16) and head_dim in (64, 128, 256) and group <= 8


@functools.lru_cache(maxsize=None)
def supports(head_dim: int, n_heads: int, n_kv_heads: int, dtype: mx.Dtype) -> bool:
    if dtype not in (mx.float16, mx.bfloat16, mx.float32) or n_heads % n_kv_heads:
        return False
    group = n_heads // n_kv_heads
    return (kernel_layout(head_dim, group, dtype) is not None
            and group * head_dim <= 3072)  # the warps' partial sums fit 48 KB of shared memory


def num_splits(batch: int, n_kv_heads: int, max_seq_len: int) -> tuple[int, int]:
    """(splits, tokens per split): split the keys only when the sequences alone leave SMs idle."""
    if batch * n_kv_heads >= TARGET_BLOCKS or max_seq_len <= MIN_SPLIT_TOKENS:
        return 1, max_seq_len
    splits = min(-(-max_seq_len // MIN_SPLIT_TOKENS), -(-TARGET_BLOCKS // (batch * n_kv_heads)))
    tokens = -(-max_seq_len // splits)
    return -(-max_seq_len // tokens), tokens


def paged_decode(q: mx.array, k_pages: mx.array, v_pages: mx.array, block_table: mx.array,
                 seq_lens: mx.array, scale: float, splits: int, split_tokens: mx.array,
                 written: Optional[mx.array] = None, init_value: Optional[float] = None,
                 threads: int = THREADS, unroll: int = UNROLL, prefetch: int = PREFETCH, vectors: int = VECTORS,
                 heads_per_block: int = HEADS_PER_BLOCK, mma: int = MMA) -> mx.array:
    """q (B, H, D), pages (num_blocks, n_kv, block_size, D), block_table (B, nb) int32,
    seq_lens (B,) int32, split_tokens (1,) int32 -> (B, H, D) in the pages' dtype.
    written: reshape_and_cache's output for these pages this step (the kernel runs after it).
    init_value fills the outputs before the kernels run (tests poison them with NaN)."""
    B, H, D = q.shape
    n_kv, bs = k_pages.shape[1], k_pages.shape[2]
    G = H // n_kv
    # Fewer heads per block: fewer registers, more warps in flight; each block reads K/V again (from L2).
    hpb = heads_per_block if 0 < heads_per_block < G and G % heads_per_block == 0 else G
    cast = (lambda x, dt: x if x.dtype == dt else x.astype(dt))
    inputs = [cast(q, k_pages.dtype), k_pages, v_pages, block_table, seq_lens, split_tokens,
              _scale_array(scale), written if written is not None else _no_write()]
    use_mma = bool(mma) and supports_mma(D, G, k_pages.dtype)
    if use_mma:  # two 16-token stages of K and V per warp in 32 KB of shared memory
        threads = 32 * max(1, min(4, 256 // D))
        template = [("T", k_pages.dtype), ("D", D), ("G", G), ("BS", bs), ("THREADS", threads)]
    else:
        tpt, vec = kernel_layout(D, hpb, k_pages.dtype, vectors)
        template = [("T", k_pages.dtype), ("D", D), ("G", hpb), ("R", G // hpb), ("BS", bs), ("THREADS", threads),
                    ("TPT", tpt), ("VEC", vec), ("U", unroll), ("PF", prefetch)]
    single, split, merge = _kernels(use_mma)
    blocks = n_kv if use_mma else H // hpb
    if splits == 1:
        return single(inputs=inputs, template=template, grid=(blocks * threads, B, 1), threadgroup=(threads, 1, 1),
                      output_shapes=[(B, H, D)], output_dtypes=[k_pages.dtype],
                      init_value=init_value)[0]
    part_acc, part_m, part_l = split(
        inputs=inputs, template=template, grid=(blocks * threads, B, splits), threadgroup=(threads, 1, 1),
        output_shapes=[(splits, B, H, D), (splits, B, H), (splits, B, H)],
        output_dtypes=[mx.float32, mx.float32, mx.float32], init_value=init_value)
    return merge(inputs=[part_acc, part_m, part_l], template=[("T", k_pages.dtype), ("D", D)],
                 grid=(H * D, B, 1), threadgroup=(D, 1, 1), output_shapes=[(B, H, D)],
                 output_dtypes=[k_pages.dtype], init_value=init_value)[0]
