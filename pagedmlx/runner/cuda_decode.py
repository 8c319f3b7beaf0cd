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
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

THREADS = 128  # 4 warps
UNROLL = 2  # token steps whose loads are issued together
PREFETCH = 1  # issue the next steps' loads before this step's math (best of the sweep on the H200, 2026-12-02)
# Settings swept on the H200 (docs/benchmarks.md, runs 13-14) that did not win broadly, kept for other GPUs:
VECTORS = 1  # 16-byte vectors per lane per token row; 2: half the lanes per token, twice the registers
HEADS_PER_BLOCK = 0  # query heads per thread block; 0: the kv head's whole group (each K/V byte read once)
TARGET_BLOCKS = 1056  # ~8 thread blocks per SM of a 132-SM GPU: enough loads in flight to hide latency
MIN_SPLIT_TOKENS = 512  # 1 x 32k keys on the H200: 64 splits 0.120 ms, 128 splits 0.139 ms (2026-12-03)

_ACCUMULATE = """
    // Lanes work in groups of TPT; each group holds one token's K/V row (VEC elements per lane,
    // read as 16-byte vectors), so a warp has TOK = 32 / TPT tokens in flight per step and U steps
    // loads issued together. Every group keeps its own online-softmax state; groups, then warps, merge at the end.
    constexpr int NW = THREADS / 32;  // warps
    constexpr int TOK = 32 / TPT;
    constexpr int NV = VEC * sizeof(T) / 16;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int sub = lane % TPT;
    const int grp = lane / TPT;
    // A block serves G query heads of one kv head; R blocks share a kv head (R = group / G).
    const int kvh = blockIdx.x / R;
    const int b = blockIdx.y;
    const int split = blockIdx.z;
    const int NKV = gridDim.x / R;
    const int H = gridDim.x * G;
    const int max_blocks = block_table_shape[1];
    const int seq_len = seq_lens[b];
    const int start = split * split_tokens[0];
    const int end = min(seq_len, start + split_tokens[0]);
    const float sc = scale[0];

    float qv[G][VEC], acc[G][VEC], m[G], l[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        const T* qp = q + ((size_t)b * H + blockIdx.x * G + g) * D + sub * VEC;
        #pragma unroll
        for (int e = 0; e < VEC; ++e) { qv[g][e] = static_cast<float>(qp[e]) * sc; acc[g][e] = 0.f; }
        m[g] = NEG_INF; l[g] = 0.f;
    }
    const int* table = block_table + (size_t)b * max_blocks;
    constexpr int STEP = NW * TOK * U;
    auto load = [&](uint4 (&kr)[U][NV], uint4 (&vr)[U][NV], bool (&ok)[U], int base) {
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * TOK + grp;
            ok[u] = t < end;
            if (ok[u]) {
                const size_t row = (((size_t)table[t / BS] * NKV + kvh) * BS + (t % BS)) * D + sub * VEC;
                const uint4* kp = reinterpret_cast<const uint4*>(k_pages + row);
                const uint4* vp = reinterpret_cast<const uint4*>(v_pages + row);
                #pragma unroll
                for (int i = 0; i < NV; ++i) { kr[u][i] = __ldg(kp + i); vr[u][i] = __ldg(vp + i); }
            }
        }
    };
    uint4 kraw[U][NV], vraw[U][NV];
    bool valid[U];
    load(kraw, vraw, valid, start + warp * TOK * U);
    for (int base = start + warp * TOK * U; base < end; base += STEP) {
        // PF: the next U steps' loads are issued before this step's math (twice the registers).
        uint4 knext[U][NV], vnext[U][NV];
        bool valid_next[U];
        if (PF) load(knext, vnext, valid_next, base + STEP);
        // Scores of all U tokens for all G heads first, reduced across the group's lanes together
        // (independent shuffles overlap); then one softmax rescale per head for the U tokens, then
        // the values. Each K/V element is converted to float once, not once per head.
        float s[U][G];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const T* kt = reinterpret_cast<const T*>(kraw[u]);
            float kf[VEC];
            #pragma unroll
            for (int e = 0; e < VEC; ++e) kf[e] = static_cast<float>(kt[e]);
            #pragma unroll
            for (int g = 0; g < G; ++g) {
                float x = 0.f;
                #pragma unroll
                for (int e = 0; e < VEC; ++e) x += qv[g][e] * kf[e];
                s[u][g] = x;
            }
        }
        #pragma unroll
        for (int o = TPT / 2; o > 0; o >>= 1) {
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                #pragma unroll
                for (int g = 0; g < G; ++g) s[u][g] += __shfl_xor_sync(0xffffffff, s[u][g], o);
            }
        }
        // s becomes each token's softmax weight under the new running max (0 for invalid tokens).
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            float m_new = m[g];
            #pragma unroll
            for (int u = 0; u < U; ++u) if (valid[u]) m_new = fmaxf(m_new, s[u][g]);
            if (m_new == NEG_INF) {  // no valid token for this group yet
                #pragma unroll
                for (int u = 0; u < U; ++u) s[u][g] = 0.f;
                continue;
            }
            const float corr = __expf(m[g] - m_new);
            l[g] *= corr;
            #pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][e] *= corr;
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                s[u][g] = valid[u] ? __expf(s[u][g] - m_new) : 0.f;
                l[g] += s[u][g];
            }
            m[g] = m_new;
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            if (valid[u]) {
                const T* vt = reinterpret_cast<const T*>(vraw[u]);
                float vf[VEC];
                #pragma unroll
                for (int e = 0; e < VEC; ++e) vf[e] = static_cast<float>(vt[e]);
                #pragma unroll
                for (int g = 0; g < G; ++g) {
                    #pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[g][e] += s[u][g] * vf[e];
                }
            }
        }
        if (PF) {
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                valid[u] = valid_next[u];
                #pragma unroll
                for (int i = 0; i < NV; ++i) { kraw[u][i] = knext[u][i]; vraw[u][i] = vnext[u][i]; }
            }
        } else {
            load(kraw, vraw, valid, base + STEP);
        }
    }
    // Merge the token groups of this warp (lanes with the same `sub`).
    #pragma unroll
    for (int o = TPT; o < 32; o <<= 1) {
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            const float m2 = __shfl_xor_sync(0xffffffff, m[g], o);
            const float l2 = __shfl_xor_sync(0xffffffff, l[g], o);
            const float M = fmaxf(m[g], m2);
            const float c1 = M == NEG_INF ? 0.f : __expf(m[g] - M);
            const float c2 = M == NEG_INF ? 0.f : __expf(m2 - M);
            #pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float a2 = __shfl_xor_sync(0xffffffff, acc[g][e], o);
                acc[g][e] = acc[g][e] * c1 + a2 * c2;
            }
            l[g] = l[g] * c1 + l2 * c2;
            m[g] = M;
        }
    }
    __shared__ float sm_m[NW * G];
    __shared__ float sm_l[NW * G];
    __shared__ float sm_acc[NW * G * D];
    if (grp == 0) {
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            #pragma unroll
            for (int e = 0; e < VEC; ++e) sm_acc[(warp * G + g) * D + sub * VEC + e] = acc[g][e];
            if (sub == 0) { sm_m[warp * G + g] = m[g]; sm_l[warp * G + g] = l[g]; }
        }
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
        const size_t h = (size_t)b * H + blockIdx.x * G + g;
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

_RESHAPE_AND_CACHE = """
    // One thread per (token, kv head, element): keys (T, NKV, DK) and values (T, NKV, DV) go to
    // pages[slot / BS, kv head, slot % BS, :], written in place (see the module docstring).
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) written[0] = 0;
    constexpr int DM = DK > DV ? DK : DV;
    const size_t t = i / (NKV * DM);
    if (t >= (size_t)keys_shape[0]) return;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const int h = (i / DM) % NKV, d = i % DM;
    const size_t page_row = ((size_t)(slot / BS) * NKV + h) * BS + slot % BS;
    if (d < DK) const_cast<P*>(k_pages)[page_row * DK + d] = static_cast<P>(static_cast<float>(keys[(t * NKV + h) * DK + d]));
    if (d < DV) const_cast<P*>(v_pages)[page_row * DV + d] = static_cast<P>(static_cast<float>(values[(t * NKV + h) * DV + d]));
"""

_HEADER = "#define NEG_INF __int_as_float(0xff800000)\n"
# `written` (the page write's output) is not read: it only orders the kernel after the write.
_INPUTS = ["q", "k_pages", "v_pages", "block_table", "seq_lens", "split_tokens", "scale", "written"]


@functools.lru_cache(maxsize=None)
def _kernels():
    single = mx.fast.cuda_kernel("pagedmlx_decode", _INPUTS, ["out"], _ACCUMULATE + _WRITE_OUT, header=_HEADER)
    split = mx.fast.cuda_kernel("pagedmlx_decode_split", _INPUTS, ["part_acc", "part_m", "part_l"],
                                _ACCUMULATE + _WRITE_SPLIT, header=_HEADER)
    merge = mx.fast.cuda_kernel("pagedmlx_decode_merge", ["part_acc", "part_m", "part_l"], ["out"], _MERGE, header=_HEADER)
    return single, split, merge


@functools.lru_cache(maxsize=None)
def _write_kernel():
    return mx.fast.cuda_kernel("pagedmlx_reshape_and_cache", ["keys", "values", "slot_mapping", "k_pages", "v_pages"],
                               ["written"], _RESHAPE_AND_CACHE)


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
                 heads_per_block: int = HEADS_PER_BLOCK) -> mx.array:
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
    tpt, vec = kernel_layout(D, hpb, k_pages.dtype, vectors)
    template = [("T", k_pages.dtype), ("D", D), ("G", hpb), ("R", G // hpb), ("BS", bs), ("THREADS", threads),
                ("TPT", tpt), ("VEC", vec), ("U", unroll), ("PF", prefetch)]
    single, split, merge = _kernels()
    if splits == 1:
        return single(inputs=inputs, template=template, grid=(H // hpb * threads, B, 1), threadgroup=(threads, 1, 1),
                      output_shapes=[(B, H, D)], output_dtypes=[k_pages.dtype],
                      init_value=init_value)[0]
    part_acc, part_m, part_l = split(
        inputs=inputs, template=template, grid=(H // hpb * threads, B, splits), threadgroup=(threads, 1, 1),
        output_shapes=[(splits, B, H, D), (splits, B, H), (splits, B, H)],
        output_dtypes=[mx.float32, mx.float32, mx.float32], init_value=init_value)
    return merge(inputs=[part_acc, part_m, part_l], template=[("T", k_pages.dtype), ("D", D)],
                 grid=(H * D, B, 1), threadgroup=(D, 1, 1), output_shapes=[(B, H, D)],
                 output_dtypes=[k_pages.dtype], init_value=init_value)[0]
