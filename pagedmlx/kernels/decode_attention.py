"""Paged decode attention, for attention layers (full, sliding window, shared KV, attention sinks), on
MLX's GPU backends, CUDA and Metal, built from one source (sources/decode_attention.py, in the
portable dialect of dialect.py).

The decode kernel reads K/V straight from the page pool through the block table: no gathered
copy. One thread group per (kv head, sequence, KV split) serves all G query heads that share the
kv head (each K/V byte is read once; heads_per_block can split a group over groups); inside it,
groups of lanes each take one token's row in 16-byte vectors, several tokens in flight per SIMD
group, with an online softmax; lane groups and SIMD groups then merge their partials. Long contexts
with few sequences are split along the keys (split-KV) and merged by a second small kernel. Both
take an optional sliding window and attention sinks (sources/decode_attention.py says how).

On CUDA, for bf16/fp16 (head_dim 64/128/256, up to 8 query heads per kv head) the accumulation runs
on tensor cores instead (sources/decode_attention_mma_cuda.py, CUDA only). The page write that
fills the pages is page_write.py; which kernels a process may trust is decided at load by
selector.py (with check.py's checks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from pagedmlx import envs
from pagedmlx.kernels import build
from pagedmlx.kernels.dialect import CUDA, METAL, render
from pagedmlx.kernels.sources import decode_attention as src
from pagedmlx.kernels.sources import decode_attention_mma_cuda as mma_src


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
    # Swept on the H200: prefetch 1 was best of the sweep; vectors 2 and
    # heads_per_block did not win broadly; the tensor cores beat the lanes (PAGEDMLX_DECODE_MMA=0 turns
    # them off); 1056 groups: ~8 per SM of 132 SMs; 512 keys a split beat 256.
    CUDA: Settings(threads=128, unroll=2, prefetch=1, vectors=1, heads_per_block=0,
                   mma=envs.PAGEDMLX_DECODE_MMA, target_blocks=1056,
                   min_split_tokens=512, shared_bytes=48 * 1024),
    # Not measured: no Mac has run these. Apple GPUs have fewer registers per thread than an H200
    # (no prefetch: half the load registers) and 10-80 cores (fewer groups fill them); 32 KB of
    # threadgroup memory.
    METAL: Settings(threads=128, unroll=2, prefetch=0, vectors=1, heads_per_block=0, mma=0, target_blocks=320,
                    min_split_tokens=512, shared_bytes=32 * 1024),
}

# `written` (the page write's output) is not read: it only orders the kernel after the write.
_INPUTS = ["q", "k_pages", "v_pages", "block_table", "seq_lens", "split_tokens", "scale", "sinks", "written"]


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


@functools.lru_cache(maxsize=None)
def _kernels(backend: str, mma: bool = False):
    """(single, split, merge) kernels; mma: the tensor-core accumulation."""
    s = decode_sources(backend, mma)
    name = "pagedmlx_paged_decode_mma" if mma else "pagedmlx_paged_decode"
    single = build.make_kernel(backend, name, _INPUTS, ["out"], *s["single"])
    split = build.make_kernel(backend, name + "_split", _INPUTS, ["part_acc", "part_m", "part_l"], *s["split"])
    merge = build.make_kernel(backend, "pagedmlx_paged_decode_merge", ["part_acc", "part_m", "part_l", "sinks"],
                              ["out"], *s["merge"])
    return single, split, merge


def merge_kernel(backend: str):
    """The kernel that merges split partials (prefill_attention.py's splits leave the same layout)."""
    return _kernels(backend)[2]


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


def refusal(head_dim: int, n_heads: int, n_kv_heads: int, dtype: mx.Dtype,
            backend: Optional[str] = None) -> Optional[str]:
    """Why the decode kernel does not take heads of this shape; None: it does."""
    if dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return f"{str(dtype).split('.')[-1]} pages"
    if n_heads % n_kv_heads:
        return f"{n_heads} query heads over {n_kv_heads} KV heads"
    # head_dim 8 (a random test model's) failed to launch on the H200 (cudaGraphAddKernelNode: invalid
    # argument, docs/benchmarks.md) where 16 and up ran; no real model has heads that small.
    if head_dim < 16:
        return f"head_dim {head_dim} < 16"
    s = SETTINGS[backend or build.gpu_backend() or CUDA]
    group = n_heads // n_kv_heads
    if kernel_layout(head_dim, group, dtype, s.vectors) is None:
        return f"no lane layout for head_dim {head_dim} with {group} query heads per KV head"
    shared = 4 * (s.threads // 32) * group * (head_dim + 2)  # the SIMD groups' partials: sm_acc, sm_m, sm_l
    if shared > s.shared_bytes:
        return f"its partials need {shared} bytes of shared memory, more than {s.shared_bytes}"
    return None


@functools.lru_cache(maxsize=None)
def supports(head_dim: int, n_heads: int, n_kv_heads: int, dtype: mx.Dtype, backend: Optional[str] = None) -> bool:
    return refusal(head_dim, n_heads, n_kv_heads, dtype, backend) is None


def supports_layer(k_dim: int, v_dim: int, n_heads: int, n_kv_heads: int, dtype: mx.Dtype,
                   backend: Optional[str] = None) -> bool:
    """The decode kernel takes the layer: keys and values of one head_dim, which `supports`. The one
    gate, at load (selector) and per layer call (attention), so the two cannot disagree."""
    return k_dim == v_dim and supports(k_dim, n_heads, n_kv_heads, dtype, backend)


def layer_refusal(k_dim: int, v_dim: int, n_heads: int, n_kv_heads: int, dtype: mx.Dtype,
                  backend: Optional[str] = None) -> Optional[str]:
    """Why the decode kernel does not take the layer (supports_layer's reason); None: it does."""
    if k_dim != v_dim:
        return f"keys of head_dim {k_dim}, values of {v_dim}"
    return refusal(k_dim, n_heads, n_kv_heads, dtype, backend)


def uses_tensor_cores(head_dim: int, group: int, dtype: mx.Dtype, backend: Optional[str],
                      settings: Optional[Settings] = None) -> bool:
    """The decode kernel accumulates on tensor cores (CUDA, supports_mma, unless PAGEDMLX_DECODE_MMA=0)."""
    s = settings or SETTINGS.get(backend)
    return backend == CUDA and s is not None and bool(s.mma) and supports_mma(head_dim, group, dtype)


def num_splits(batch: int, n_kv_heads: int, max_seq_len: int, window: Optional[int] = None,
               backend: Optional[str] = None) -> tuple[int, int]:
    """(splits, tokens per split): split the keys only when the sequences alone leave the GPU idle.
    Under a window a sequence has at most `window` keys, whatever its length."""
    s = SETTINGS[backend or build.gpu_backend() or CUDA]
    span = max(1, min(max_seq_len, window) if window else max_seq_len)
    if batch * n_kv_heads >= s.target_blocks or span <= s.min_split_tokens:
        return 1, span
    splits = min(-(-span // s.min_split_tokens), -(-s.target_blocks // (batch * n_kv_heads)))
    tokens = -(-span // splits)
    return -(-span // tokens), tokens


@functools.lru_cache(maxsize=None)
def _launch(D: int, H: int, n_kv: int, bs: int, dtype: mx.Dtype, window: int, sinks: bool, backend: str,
            s: Settings) -> tuple[list, int, int, bool]:
    """(template, thread groups per sequence, threads, tensor cores) of a layer's decode launch: the
    same every step, so made once (each layer call is host work of every step)."""
    G = H // n_kv
    # Fewer heads per group: fewer registers, more SIMD groups in flight; each reads K/V again (from L2).
    hpb = s.heads_per_block if 0 < s.heads_per_block < G and G % s.heads_per_block == 0 else G
    flags = [("WINDOW", window), ("SINKS", int(sinks))]
    if uses_tensor_cores(D, G, dtype, backend, s):  # two 16-token stages of K and V per warp in 32 KB of shared memory
        threads = 32 * max(1, min(4, 256 // D))
        return [("T", dtype), ("D", D), ("G", G), ("BS", bs), ("THREADS", threads)] + flags, n_kv, threads, True
    tpt, vec = kernel_layout(D, hpb, dtype, s.vectors)
    template = [("T", dtype), ("D", D), ("G", hpb), ("R", G // hpb), ("BS", bs), ("THREADS", s.threads),
                ("TPT", tpt), ("VEC", vec), ("U", s.unroll), ("PF", s.prefetch)] + flags
    return template, H // hpb, s.threads, False


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
    backend = backend or build.gpu_backend()
    s = settings or SETTINGS[backend]
    B, H, D = q.shape
    dtype = k_pages.dtype
    sink_input = (build.device_constant(0.0, mx.float32) if sinks is None
                  else sinks if sinks.dtype == mx.float32 else sinks.astype(mx.float32))
    inputs = [q if q.dtype == dtype else q.astype(dtype), k_pages, v_pages, block_table, seq_lens, split_tokens,
              build.device_constant(scale, mx.float32), sink_input,
              written if written is not None else build.device_constant(0, mx.int32)]
    template, blocks, threads, use_mma = _launch(D, H, k_pages.shape[1], k_pages.shape[2], dtype, int(window or 0),
                                                 sinks is not None, backend, s)
    single, split, merge = _kernels(backend, use_mma)
    if splits == 1:
        return single(inputs=inputs, template=template, grid=(blocks * threads, B, 1), threadgroup=(threads, 1, 1),
                      output_shapes=[(B, H, D)], output_dtypes=[dtype], init_value=init_value)[0]
    part_acc, part_m, part_l = split(
        inputs=inputs, template=template, grid=(blocks * threads, B, splits), threadgroup=(threads, 1, 1),
        output_shapes=[(splits, B, H, D), (splits, B, H), (splits, B, H)],
        output_dtypes=[mx.float32, mx.float32, mx.float32], init_value=init_value)
    return merge(inputs=[part_acc, part_m, part_l, sink_input],
                 template=[("T", dtype), ("D", D), ("SINKS", int(sinks is not None))],
                 grid=(H * D, B, 1), threadgroup=(D, 1, 1), output_shapes=[(B, H, D)],
                 output_dtypes=[dtype], init_value=init_value)[0]
