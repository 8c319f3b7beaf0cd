"""Paged-decode attention kernel for MLX's CUDA backend.

Reads K/V straight from the page pool through the block table: no gathered copy. One thread block
per (kv head, sequence, KV split); each warp walks the split's tokens (one token per warp step,
its K row read coalesced across the lanes) for all G query heads that share the kv head, with an
online softmax; the warps then merge through shared memory. Long contexts with few sequences are
split along the keys (split-KV) and merged by a second small kernel.
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

THREADS = 128  # 4 warps
TARGET_BLOCKS = 1024  # enough thread blocks to keep every SM of a large GPU busy
MIN_SPLIT_TOKENS = 256

_ACCUMULATE = """
    constexpr int NW = THREADS / 32;
    constexpr int EPL = D / 32;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int kvh = blockIdx.x;
    const int b = blockIdx.y;
    const int split = blockIdx.z;
    const int NKV = gridDim.x;
    const int H = NKV * G;
    const int max_blocks = block_table_shape[1];
    const int seq_len = seq_lens[b];
    const int start = split * split_tokens[0];
    const int end = min(seq_len, start + split_tokens[0]);
    const float sc = scale[0];

    float qv[G][EPL];
    float m[G], l[G], acc[G][EPL];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        const T* qp = q + ((size_t)b * H + kvh * G + g) * D + lane * EPL;
        #pragma unroll
        for (int e = 0; e < EPL; ++e) { qv[g][e] = static_cast<float>(qp[e]) * sc; acc[g][e] = 0.f; }
        m[g] = NEG_INF; l[g] = 0.f;
    }
    const int* table = block_table + (size_t)b * max_blocks;
    for (int t = start + warp; t < end; t += NW) {
        const size_t row = (((size_t)table[t / BS] * NKV + kvh) * BS + (t % BS)) * D + lane * EPL;
        float kf[EPL], vf[EPL];
        #pragma unroll
        for (int e = 0; e < EPL; ++e) { kf[e] = static_cast<float>(k_pages[row + e]); vf[e] = static_cast<float>(v_pages[row + e]); }
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            float s = 0.f;
            #pragma unroll
            for (int e = 0; e < EPL; ++e) s += qv[g][e] * kf[e];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
            const float m_new = fmaxf(m[g], s);
            const float corr = __expf(m[g] - m_new);
            const float p = __expf(s - m_new);
            l[g] = l[g] * corr + p;
            #pragma unroll
            for (int e = 0; e < EPL; ++e) acc[g][e] = acc[g][e] * corr + p * vf[e];
            m[g] = m_new;
        }
    }
    __shared__ float sm_m[NW * G];
    __shared__ float sm_l[NW * G];
    __shared__ float sm_acc[NW * G * D];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        #pragma unroll
        for (int e = 0; e < EPL; ++e) sm_acc[(warp * G + g) * D + lane * EPL + e] = acc[g][e];
        if (lane == 0) { sm_m[warp * G + g] = m[g]; sm_l[warp * G + g] = l[g]; }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += THREADS) {
        const int g = i / D, d = i % D;
        float M = NEG_INF;
        for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w * G + g]);
        float L = 0.f, A = 0.f;
        if (M != NEG_INF) {
            for (int w = 0; w < NW; ++w) {
                const float c = __expf(sm_m[w * G + g] - M);
                L += sm_l[w * G + g] * c;
                A += sm_acc[(w * G + g) * D + d] * c;
            }
        }
        const size_t h = (size_t)b * H + kvh * G + g;
"""

_WRITE_OUT = """
        out[h * D + d] = static_cast<T>(L > 0.f ? A / L : 0.f);
    }
"""

_WRITE_SPLIT = """
        const size_t ph = (size_t)split * gridDim.y * H + h;
        part_acc[ph * D + d] = A;
        if (d == 0) { part_m[ph] = M; part_l[ph] = L; }
    }
"""

_MERGE = """
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int d = threadIdx.x;
    const int H = gridDim.x;
    const int B = gridDim.y;
    const int splits = part_m_shape[0];
    float M = NEG_INF;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, part_m[((size_t)s * B + b) * H + h]);
    float L = 0.f, A = 0.f;
    if (M != NEG_INF) {
        for (int s = 0; s < splits; ++s) {
            const size_t ph = ((size_t)s * B + b) * H + h;
            const float c = __expf(part_m[ph] - M);
            L += part_l[ph] * c;
            A += part_acc[ph * D + d] * c;
        }
    }
    out[((size_t)b * H + h) * D + d] = static_cast<T>(L > 0.f ? A / L : 0.f);
"""

_HEADER = "#define NEG_INF __int_as_float(0xff800000)\n"
_INPUTS = ["q", "k_pages", "v_pages", "block_table", "seq_lens", "split_tokens", "scale"]


@functools.lru_cache(maxsize=None)
def _kernels():
    single = mx.fast.cuda_kernel("pagedmlx_decode", _INPUTS, ["out"], _ACCUMULATE + _WRITE_OUT, header=_HEADER)
    split = mx.fast.cuda_kernel("pagedmlx_decode_split", _INPUTS, ["part_acc", "part_m", "part_l"],
                                _ACCUMULATE + _WRITE_SPLIT, header=_HEADER)
    merge = mx.fast.cuda_kernel("pagedmlx_decode_merge", ["part_acc", "part_m", "part_l"], ["out"], _MERGE, header=_HEADER)
    return single, split, merge


def is_available() -> bool:
    try:
        return mx.default_device() == mx.gpu and mx.cuda.is_available()
    except AttributeError:
        return False


def supports(head_dim: int, n_heads: int, n_kv_heads: int, dtype: mx.Dtype) -> bool:
    group = n_heads // n_kv_heads
    return (head_dim % 32 == 0 and head_dim <= 256 and n_heads % n_kv_heads == 0
            and group * head_dim <= 3072  # the warps' partial sums must fit 48 KB of shared memory
            and dtype in (mx.float16, mx.bfloat16, mx.float32))


def num_splits(batch: int, n_kv_heads: int, max_seq_len: int) -> tuple[int, int]:
    """(splits, tokens per split): split the keys only when the sequences alone leave SMs idle."""
    if batch * n_kv_heads >= TARGET_BLOCKS // 4 or max_seq_len <= MIN_SPLIT_TOKENS:
        return 1, max_seq_len
    splits = min(-(-max_seq_len // MIN_SPLIT_TOKENS), max(1, TARGET_BLOCKS // (batch * n_kv_heads)))
    tokens = -(-max_seq_len // splits)
    return -(-max_seq_len // tokens), tokens


def paged_decode(q: mx.array, k_pages: mx.array, v_pages: mx.array, block_table: mx.array,
                 seq_lens: mx.array, scale: float, splits: int, split_tokens: mx.array,
                 init_value: Optional[float] = None) -> mx.array:
    """q (B, H, D), pages (num_blocks, n_kv, block_size, D), block_table (B, nb) int32,
    seq_lens (B,) int32, split_tokens (1,) int32 -> (B, H, D) in q's dtype.
    init_value fills the outputs before the kernels run (tests poison them with NaN)."""
    B, H, D = q.shape
    n_kv, bs = k_pages.shape[1], k_pages.shape[2]
    G = H // n_kv
    inputs = [q.astype(k_pages.dtype), k_pages, v_pages, block_table, seq_lens, split_tokens,
              mx.array([scale], mx.float32)]
    template = [("T", k_pages.dtype), ("D", D), ("G", G), ("BS", bs), ("THREADS", THREADS)]
    single, split, merge = _kernels()
    if splits == 1:
        return single(inputs=inputs, template=template, grid=(n_kv * THREADS, B, 1), threadgroup=(THREADS, 1, 1),
                      output_shapes=[(B, H, D)], output_dtypes=[k_pages.dtype],
                      init_value=init_value)[0].astype(q.dtype)
    part_acc, part_m, part_l = split(
        inputs=inputs, template=template, grid=(n_kv * THREADS, B, splits), threadgroup=(THREADS, 1, 1),
        output_shapes=[(splits, B, H, D), (splits, B, H), (splits, B, H)],
        output_dtypes=[mx.float32, mx.float32, mx.float32], init_value=init_value)
    return merge(inputs=[part_acc, part_m, part_l], template=[("T", k_pages.dtype), ("D", D)],
                 grid=(H * D, B, 1), threadgroup=(D, 1, 1), output_shapes=[(B, H, D)],
                 output_dtypes=[k_pages.dtype], init_value=init_value)[0].astype(q.dtype)
