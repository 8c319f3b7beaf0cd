"""Paged KV kernels for MLX's GPU backends, CUDA and Metal, built from one source (paged_sources.py,
in the portable dialect of dialect.py): the page write (reshape_and_cache) and paged-decode attention.

The page write stores each new token's K/V at its slot in place, through the input pointers: MLX
sees the pools as arrays that never change, so no write can turn into a copy of a whole pool
(which MLX's scatter does whenever anything else still references the pool, e.g. the step in
flight), and step N+1 can be dispatched while step N runs. Its small `written` output is an input
of every reader of that layer's pages in the step: MLX orders kernels by the buffers they share
(CUDA graphs; Metal's barriers between dependent dispatches), so this keeps a read after the write.

The decode kernel reads K/V straight from the page pool through the block table: no gathered
copy. One thread group per (kv head, sequence, KV split) serves all G query heads that share the
kv head (each K/V byte is read once; heads_per_block can split a group over groups); inside it,
groups of lanes each take one token's row in 16-byte vectors, several tokens in flight per SIMD
group, with an online softmax; lane groups and SIMD groups then merge their partials. Long contexts
with few sequences are split along the keys (split-KV) and merged by a second small kernel. Both
take an optional sliding window and attention sinks (paged_sources.py says how).

On CUDA, for bf16/fp16 (head_dim 64/128/256, up to 8 query heads per kv head) the accumulation runs
on tensor cores instead (cuda_mma_sources.py, CUDA only). Which kernels a process may trust is
decided at load by kernel_check.py.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from pagedmlx.platform import gpu_backend_name
from pagedmlx.kv.spec import cdiv
from pagedmlx.runner import cuda_mma_sources as mma_src
from pagedmlx.runner import cuda_prefill_sources as prefill_src
from pagedmlx.runner import paged_sources as src
from pagedmlx.runner.dialect import CUDA, METAL, render


@dataclass(frozen=True)
class Settings:
    threads: int  # per thread group (a multiple of 32: SIMD groups of 32 lanes on both backends)
    unroll: int  # token steps whose loads are issued together
    prefetch: int  # issue the next steps' loads before this step's math
    vectors: int  # 16-byte vectors per lane per token row; 2: half the lanes per token, twice the registers
    heads_per_block: int  # query heads per thread group; 0: the kv head's whole group (each K/V byte read once)
    mma: int  # tensor cores where supports_mma (CUDA only)
    target_blocks: int  # thread groups that fill the GPU: fewer, and long contexts are split along the keys
    min_split_tokens: int  # keys per split at least
    shared_bytes: int  # static shared (threadgroup) memory a kernel may declare


SETTINGS = {
    # Swept on the H200 (docs/benchmarks.md, runs 13-16): prefetch 1 was best of the sweep; vectors 2 and
    # heads_per_block did not win broadly; the tensor cores beat the lanes (PAGEDMLX_DECODE_MMA=0 turns
    # them off); 1056 groups: ~8 per SM of 132 SMs; 512 keys a split beat 256.
    CUDA: Settings(threads=128, unroll=2, prefetch=1, vectors=1, heads_per_block=0,
                   mma=int(os.environ.get("PAGEDMLX_DECODE_MMA", "1")), target_blocks=1056,
                   min_split_tokens=512, shared_bytes=48 * 1024),
    # Not measured: no Mac has run these. Apple GPUs have fewer registers per thread than an H200
    # (no prefetch: half the load registers) and 10-80 cores (fewer groups fill them); 32 KB of
    # threadgroup memory.
    METAL: Settings(threads=128, unroll=2, prefetch=0, vectors=1, heads_per_block=0, mma=0, target_blocks=320,
                    min_split_tokens=512, shared_bytes=32 * 1024),
}

# `written` (the page write's output) is not read: it only orders the kernel after the write.
_INPUTS = ["q", "k_pages", "v_pages", "block_table", "seq_lens", "split_tokens", "scale", "sinks", "written"]
_BACKENDS = {"CUDA": CUDA, "Metal": METAL}  # platform.gpu_backend_name -> the dialect's name


def gpu_backend() -> Optional[str]:
    """CUDA or METAL where MLX's default device is a GPU of that backend; None elsewhere."""
    return _BACKENDS.get(gpu_backend_name()) if mx.default_device() == mx.gpu else None


def make_kernel(backend: str, name: str, inputs: list[str], outputs: list[str], source: str, header: str):
    """The one place kernels are built (tests stand in for it). Sources are already rendered; the
    name carries their hash, so no cache keyed by name (MLX's JIT caches) serves an older text."""
    name = f"{name}_{hashlib.sha1((header + source).encode()).hexdigest()[:10]}"
    if backend == CUDA:
        return mx.fast.cuda_kernel(name, inputs, outputs, source, header=header)
    return mx.fast.metal_kernel(name, inputs, outputs, source, header=header)


def decode_sources(backend: str, mma: bool = False) -> dict[str, tuple[str, str]]:
    """{kernel: (body, header)} of the decode kernels, rendered for `backend`."""
    if mma and backend != CUDA:
        raise ValueError("the tensor-core kernel is CUDA only")
    header = render(src.HEADER, backend) + (mma_src.MMA_HEADER if mma else "")
    accumulate = render(mma_src.ACCUMULATE_MMA if mma else src.ACCUMULATE, backend)
    merge_warps = accumulate + render(src.MERGE_WARPS, backend)
    return {"single": (merge_warps + render(src.WRITE_OUT, backend), header),
            "split": (merge_warps + render(src.WRITE_SPLIT, backend), header),
            "merge": (render(src.MERGE, backend), render(src.HEADER, backend))}


def write_source(backend: str) -> str:
    return render(src.RESHAPE_AND_CACHE, backend)


@functools.lru_cache(maxsize=None)
def _kernels(backend: str, mma: bool = False):
    """(single, split, merge) kernels; mma: the tensor-core accumulation."""
    s = decode_sources(backend, mma)
    name = "pagedmlx_paged_decode_mma" if mma else "pagedmlx_paged_decode"
    single = make_kernel(backend, name, _INPUTS, ["out"], *s["single"])
    split = make_kernel(backend, name + "_split", _INPUTS, ["part_acc", "part_m", "part_l"], *s["split"])
    merge = make_kernel(backend, "pagedmlx_paged_decode_merge", ["part_acc", "part_m", "part_l", "sinks"], ["out"],
                        *s["merge"])
    return single, split, merge


@functools.lru_cache(maxsize=None)
def _write_kernel(backend: str):
    return make_kernel(backend, "pagedmlx_reshape_and_cache", ["keys", "values", "slot_mapping", "k_pages", "v_pages"],
                       ["written"], write_source(backend), "")


def reshape_and_cache(keys: mx.array, values: mx.array, k_pages: mx.array, v_pages: mx.array,
                      slot_mapping: mx.array, backend: Optional[str] = None) -> mx.array:
    """Write keys (T, n_kv, 1, Dk) and values (T, n_kv, 1, Dv) into the pages at slot_mapping (T,)
    int32 (block * block_size + offset; negative: skip), in place. Returns `written`, a (1,) int32
    zero that every reader of these pages in the step must take as an input (a view of a 4-element
    output: see _constant)."""
    T, n_kv, _, dk = keys.shape
    dv = values.shape[3]
    bs = k_pages.shape[2]
    template = [("P", k_pages.dtype), ("KT", keys.dtype), ("NKV", n_kv), ("DK", dk), ("DV", dv), ("BS", bs)]
    return _write_kernel(backend or gpu_backend())(
        inputs=[keys, values, slot_mapping, k_pages, v_pages], template=template,
        grid=(max(T * n_kv * max(dk, dv), 1), 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(4,)], output_dtypes=[mx.int32])[0][:1]


@functools.lru_cache(maxsize=None)
def _constant(value: float, dtype: mx.Dtype) -> mx.array:
    """A device constant, made once: a host-made array per layer call would cost an upload each.
    Padded past 8 bytes: MLX's CUDA allocator pools arrays of <= 8 bytes in managed pages that
    the host writes small arrays into too."""
    return mx.full((4,), value, dtype)


def lane_layout(head_dim: int, dtype: mx.Dtype, vectors: int = 1) -> Optional[tuple[int, int]]:
    """(lanes per token, elements per lane) such that each lane reads `vectors` whole 16-byte vectors."""
    tpt = min(32, head_dim * dtype.size // (16 * vectors))
    if tpt < 1 or 32 % tpt or head_dim % tpt or (head_dim // tpt) * dtype.size % 16:
        return None
    return tpt, head_dim // tpt


@functools.lru_cache(maxsize=None)
def kernel_layout(head_dim: int, group: int, dtype: mx.Dtype, vectors: int = 1) -> Optional[tuple[int, int]]:
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
def supports(head_dim: int, n_heads: int, n_kv_heads: int, dtype: mx.Dtype, backend: Optional[str] = None) -> bool:
    # head_dim 8 (a random test model's) failed to launch on the H200 (cudaGraphAddKernelNode: invalid
    # argument, docs/benchmarks.md run 21) where 16 and up ran; no real model has heads that small.
    if dtype not in (mx.float16, mx.bfloat16, mx.float32) or n_heads % n_kv_heads or head_dim < 16:
        return False
    s = SETTINGS[backend or gpu_backend() or CUDA]
    group = n_heads // n_kv_heads
    shared = 4 * (s.threads // 32) * group * (head_dim + 2)  # the SIMD groups' partials: sm_acc, sm_m, sm_l
    return kernel_layout(head_dim, group, dtype, s.vectors) is not None and shared <= s.shared_bytes


def supports_layer(k_dim: int, v_dim: int, n_heads: int, n_kv_heads: int, dtype: mx.Dtype,
                   backend: Optional[str] = None) -> bool:
    """The decode kernel takes the layer: keys and values of one head_dim, which `supports`. The one
    gate, at load (kernel_check) and per layer call (attention), so the two cannot disagree."""
    return k_dim == v_dim and supports(k_dim, n_heads, n_kv_heads, dtype, backend)


def num_splits(batch: int, n_kv_heads: int, max_seq_len: int, window: Optional[int] = None,
               backend: Optional[str] = None) -> tuple[int, int]:
    """(splits, tokens per split): split the keys only when the sequences alone leave the GPU idle.
    Under a window a sequence has at most `window` keys, whatever its length."""
    s = SETTINGS[backend or gpu_backend() or CUDA]
    span = max(1, min(max_seq_len, window) if window else max_seq_len)
    if batch * n_kv_heads >= s.target_blocks or span <= s.min_split_tokens:
        return 1, span
    splits = min(-(-span // s.min_split_tokens), -(-s.target_blocks // (batch * n_kv_heads)))
    tokens = -(-span // splits)
    return -(-span // tokens), tokens


def paged_decode(q: mx.array, k_pages: mx.array, v_pages: mx.array, block_table: mx.array,
                 seq_lens: mx.array, scale: float, splits: int, split_tokens: mx.array,
                 written: Optional[mx.array] = None, window: Optional[int] = None, sinks: Optional[mx.array] = None,
                 init_value: Optional[float] = None, settings: Optional[Settings] = None,
                 backend: Optional[str] = None) -> mx.array:
    """q (B, H, D), pages (num_blocks, n_kv, block_size, D), block_table (B, nb) int32,
    seq_lens (B,) int32, split_tokens (1,) int32 -> (B, H, D) in the pages' dtype.
    `splits` x split_tokens must cover each sequence's keys (num_splits gives both).
    written: reshape_and_cache's output for these pages this step (the kernel runs after it).
    window: attend only the last `window` keys (positions >= seq_len - window); None or 0: all.
    sinks: (H,) per-head logits joining the softmax's denominator with a zero value (gpt-oss).
    init_value fills the outputs before the kernels run (tests poison them with NaN).
    settings: other than the backend's SETTINGS (benchmark sweeps)."""
    backend = backend or gpu_backend()
    s = settings or SETTINGS[backend]
    B, H, D = q.shape
    n_kv, bs = k_pages.shape[1], k_pages.shape[2]
    G = H // n_kv
    # Fewer heads per group: fewer registers, more SIMD groups in flight; each reads K/V again (from L2).
    hpb = s.heads_per_block if 0 < s.heads_per_block < G and G % s.heads_per_block == 0 else G
    cast = (lambda x, dt: x if x.dtype == dt else x.astype(dt))
    sink_input = _constant(0.0, mx.float32) if sinks is None else cast(sinks, mx.float32)
    inputs = [cast(q, k_pages.dtype), k_pages, v_pages, block_table, seq_lens, split_tokens,
              _constant(scale, mx.float32), sink_input, written if written is not None else _constant(0, mx.int32)]
    flags = [("WINDOW", int(window or 0)), ("SINKS", int(sinks is not None))]
    use_mma = backend == CUDA and bool(s.mma) and supports_mma(D, G, k_pages.dtype)
    if use_mma:  # two 16-token stages of K and V per warp in 32 KB of shared memory
        threads = 32 * max(1, min(4, 256 // D))
        template = [("T", k_pages.dtype), ("D", D), ("G", G), ("BS", bs), ("THREADS", threads)] + flags
        blocks = n_kv
    else:
        threads = s.threads
        tpt, vec = kernel_layout(D, hpb, k_pages.dtype, s.vectors)
        template = [("T", k_pages.dtype), ("D", D), ("G", hpb), ("R", G // hpb), ("BS", bs), ("THREADS", threads),
                    ("TPT", tpt), ("VEC", vec), ("U", s.unroll), ("PF", s.prefetch)] + flags
        blocks = H // hpb
    single, split, merge = _kernels(backend, use_mma)
    if splits == 1:
        return single(inputs=inputs, template=template, grid=(blocks * threads, B, 1), threadgroup=(threads, 1, 1),
                      output_shapes=[(B, H, D)], output_dtypes=[k_pages.dtype], init_value=init_value)[0]
    part_acc, part_m, part_l = split(
        inputs=inputs, template=template, grid=(blocks * threads, B, splits), threadgroup=(threads, 1, 1),
        output_shapes=[(splits, B, H, D), (splits, B, H), (splits, B, H)],
        output_dtypes=[mx.float32, mx.float32, mx.float32], init_value=init_value)
    return merge(inputs=[part_acc, part_m, part_l, sink_input],
                 template=[("T", k_pages.dtype), ("D", D), ("SINKS", int(sinks is not None))],
                 grid=(H * D, B, 1), threadgroup=(D, 1, 1), output_shapes=[(B, H, D)],
                 output_dtypes=[k_pages.dtype], init_value=init_value)[0]



# ---- paged prefill (CUDA, tensor cores) --------------------------------------------------------

_PREFILL_INPUTS = ["q", "k_pages", "v_pages", "block_table", "segs", "tiles", "split_tokens", "scale", "sinks",
                   "written"]
PREFILL_TILE = 16  # query tokens per tile (cuda_prefill_sources.py: TQ)
PREFILL_HEAD_DIMS = (64, 128)
PREFILL_MAX_GROUP = 8  # query heads per KV head: one warp each, at most 256 threads a block
# Split the keys while the tiles alone would keep fewer warps in flight than this (132 SMs x 16),
# each split at least PREFILL_MIN_SPLIT keys.
PREFILL_TARGET_WARPS = 2112
PREFILL_MIN_SPLIT = 1024
# Steps whose prefill segments all have at most this many new tokens go through the kernel; larger
# chunks through MLX's attention (cuDNN), which runs one 8,192-token chunk 2-3x faster and one of 512
# tokens over 8k keys 1.4x faster, while the kernel is 1.2-1.4x faster at 256 tokens a segment and
# 3.3x on a burst's step of 30 such segments (H200, bench_prefill_attention.py and
# profile_prefill_steps.py, runs 32-34). CUDA's chunk cap beside decodes is 256.
PREFILL_KERNEL_MAX_QUERY = 256


def prefill_sources() -> dict[str, tuple[str, str]]:
    """{kernel: (body, header)} of the paged prefill kernels (CUDA only)."""
    header = mma_src.MMA_HEADER + prefill_src.PREFILL_HEADER
    body = render(prefill_src.ACCUMULATE, CUDA)
    return {"single": (body + render(prefill_src.WRITE_OUT, CUDA), header),
            "split": (body + render(prefill_src.WRITE_SPLIT, CUDA), header)}


@functools.lru_cache(maxsize=None)
def _prefill_kernels():
    s = prefill_sources()
    single = make_kernel(CUDA, "pagedmlx_paged_prefill", _PREFILL_INPUTS, ["out"], *s["single"])
    split = make_kernel(CUDA, "pagedmlx_paged_prefill_split", _PREFILL_INPUTS, ["part_acc", "part_m", "part_l"],
                        *s["split"])
    return single, split


def supports_prefill(k_dim: int, v_dim: int, n_heads: int, n_kv_heads: int, dtype: mx.Dtype) -> bool:
    """The prefill kernel takes the layer: 16-bit floats, one head_dim it is built for, <= 8 heads per KV head."""
    return (dtype in (mx.float16, mx.bfloat16) and k_dim == v_dim and k_dim in PREFILL_HEAD_DIMS
            and n_heads % n_kv_heads == 0 and n_heads // n_kv_heads <= PREFILL_MAX_GROUP)


def prefill_splits(num_tiles: int, n_kv_heads: int, group: int, max_keys: int) -> tuple[int, int]:
    """(splits, keys per split) for tiles whose longest key range is max_keys."""
    warps = num_tiles * n_kv_heads * group
    if warps >= PREFILL_TARGET_WARPS or max_keys < 2 * PREFILL_MIN_SPLIT:
        return 1, max(max_keys, 1)
    splits = min(max_keys // PREFILL_MIN_SPLIT, cdiv(PREFILL_TARGET_WARPS, warps))
    tokens = cdiv(max_keys, splits)
    return cdiv(max_keys, tokens), tokens


def paged_prefill(q: mx.array, k_pages: mx.array, v_pages: mx.array, block_table: mx.array, segs: mx.array,
                  tiles: mx.array, scale: float, splits: int, split_tokens: mx.array,
                  written: Optional[mx.array] = None, window: Optional[int] = None, sinks: Optional[mx.array] = None,
                  init_value: Optional[float] = None) -> mx.array:
    """Causal attention of every prefill segment over its pages, in one launch (CUDA).
    q (Tp, H, D): the step's prefill rows; segs (S, 4) int32: per segment its first row in q, its new
    tokens n, the position of the first and key_offset (the position of the first key its row of
    block_table (S, nb) holds: 0, or a page boundary before its window); tiles (NT, 2) int32: (segment,
    first token) of each 16-token tile; splits x split_tokens (1,) must cover each tile's keys
    (prefill_splits). window, sinks, written, init_value: as paged_decode. -> (Tp, H, D), pages' dtype."""
    Tp, H, D = q.shape
    n_kv, bs = k_pages.shape[1], k_pages.shape[2]
    G = H // n_kv
    sink_input = _constant(0.0, mx.float32) if sinks is None else sinks.astype(mx.float32)
    inputs = [q if q.dtype == k_pages.dtype else q.astype(k_pages.dtype), k_pages, v_pages, block_table, segs, tiles,
              split_tokens, _constant(scale, mx.float32), sink_input,
              written if written is not None else _constant(0, mx.int32)]
    template = [("T", k_pages.dtype), ("D", D), ("G", G), ("BS", bs), ("WINDOW", int(window or 0))]
    launch = dict(grid=(tiles.shape[0] * 32 * G, n_kv, splits), threadgroup=(32 * G, 1, 1), init_value=init_value)
    single, split = _prefill_kernels()
    if splits == 1:
        return single(inputs=inputs, template=template + [("SINKS", int(sinks is not None))],
                      output_shapes=[(Tp, H, D)], output_dtypes=[k_pages.dtype], **launch)[0]
    # Split: the merge adds the sink term.
    parts = split(inputs=inputs, template=template, output_shapes=[(splits, Tp, H, D), (splits, Tp, H), (splits, Tp, H)],
                  output_dtypes=[mx.float32] * 3, **launch)
    merge = _kernels(CUDA)[2]  # the decode kernels' merge: the same partials' layout
    return merge(inputs=[*parts, sink_input], template=[("T", k_pages.dtype), ("D", D), ("SINKS", int(sinks is not None))],
                 grid=(H * D, Tp, 1), threadgroup=(D, 1, 1), output_shapes=[(Tp, H, D)],
                 output_dtypes=[k_pages.dtype], init_value=init_value)[0]
