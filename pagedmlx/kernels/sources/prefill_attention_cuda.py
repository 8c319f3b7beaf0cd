"""CUDA source of paged prefill attention on tensor cores (sm_80+): every prefill segment of a step in
one launch, causal, reading K/V straight from the pages through each segment's block table.

Work is cut into tiles of 16 query tokens of one segment (prefill_indices.prefill_tile_indices). A
thread block takes one tile for one KV head (and one split of its keys): one warp per query head of
the KV head's group, so each warp holds 16 rows (16 tokens of one head) and K/V tiles, staged in
shared memory by cp.async, are read once for the G heads. Per stage of KT keys a warp computes
S = Q K^T (mma.sync m16n8k16, all 16 rows), masks it (causal, the split's end, the window), runs
the online softmax on S's accumulators and adds P V, P taken from S's registers as they stand.

Keys of a tile are [lo, hi): hi = the position after its last token, lo = 0, or under a sliding
window the first key its first token sees (never before the segment's key_offset, the first key
its block table holds). Split s takes [lo + s * split_tokens, ...). Unsplit, the kernel writes the
output (with the sink term); split, each split writes its partials (float32 weighted values,
running max and sum) in the decode kernel's layout, and decode_attention.MERGE merges them.

Rendered through the dialect for CUDA (NEG_INF) like the decode kernels; decode_attention_mma_cuda.MMA_HEADER
holds the PTX helpers shared with the decode kernel.
"""

PREFILL_HEADER = r"""
// d += A (16 x 16, all rows) * B (16 x 8): a[0] = A[g][2t..], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..],
// a[3] = A[g+8][2t+8..]; d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..2t+1].
__device__ inline void mma16816_rows(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, __nv_bfloat16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ inline void mma16816_rows(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, __half) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"""  # noqa: E501 - kernel source text, kept verbatim

# A stage of KT keys' K and V rows, 16-byte chunks copied by cp.async into the swizzled tiles
# (sources/prefill_attention_quant_cuda.py replaces it for quantized pages).
STAGE_LOAD = """    auto load = [&](int stage, int base) {
        for (int c = threadIdx.x; c < KT * CH; c += THREADS) {
            const int row = c / CH, chunk = c % CH;
            const int key = base + row;
            const bool ok = key < end;
            const size_t src = ok ? (((size_t)table[(key - key_offset) / BS] * NKV + kvh) * BS + key % BS) * D + chunk * 8 : 0;
            const int dst = row * D + ((chunk ^ (row & 7)) * 8);
            cp_async16(&kv[stage][0][dst], k_pages + src, ok);
            cp_async16(&kv[stage][1][dst], v_pages + src, ok);
        }
        cp_async_commit();
    };
"""  # noqa: E501 - kernel source text, kept verbatim

ACCUMULATE = """
    constexpr int THREADS = 32 * G;  // one warp per query head of the KV head's group
    constexpr int TQ = 16;  // query tokens per tile
    constexpr int CH = D / 8;  // 16-byte chunks per K/V row
    constexpr int KS = D / 16;  // k-steps of Q K^T
    constexpr int NT = D / 8;  // n-tiles of P V
    constexpr int KT = 4096 / D;  // keys per stage: K and V tiles of 8 KB each, two stages
    constexpr int NJ = KT / 8;  // n-tiles of S per stage
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x;
    const int kvh = blockIdx.y;
    const int split = blockIdx.z;
    const int NKV = gridDim.y;
    const int H = NKV * G;
    const int head = kvh * G + warp;
    const int seg = tiles[2 * tile];
    const int tok0 = tiles[2 * tile + 1];
    const int q_row = segs[4 * seg];
    const int n = segs[4 * seg + 1];
    const int first_pos = segs[4 * seg + 2];
    const int key_offset = segs[4 * seg + 3];
    const int* table = block_table + (size_t)seg * block_table_shape[1];
    const int lo = WINDOW > 0 ? max(key_offset, first_pos + tok0 - WINDOW + 1) : key_offset;
    const int hi = first_pos + min(n, tok0 + TQ);
    const int start = lo + split * split_tokens[0];
    const int end = min(hi, start + split_tokens[0]);
    const float sc = scale[0];

    // Rows g and g + 8 of this warp: tokens ta and tb of the tile (position -1: a missing token,
    // which sees no key).
    const int ta = tok0 + g, tb = tok0 + g + 8;
    const int pos_a = ta < n ? first_pos + ta : -1;
    const int pos_b = tb < n ? first_pos + tb : -1;
    unsigned qa[KS][4];
    {
        const unsigned* pa = reinterpret_cast<const unsigned*>(q + ((size_t)(q_row + (ta < n ? ta : 0)) * H + head) * D + 2 * t);
        const unsigned* pb = reinterpret_cast<const unsigned*>(q + ((size_t)(q_row + (tb < n ? tb : 0)) * H + head) * D + 2 * t);
        #pragma unroll
        for (int k = 0; k < KS; ++k) {
            qa[k][0] = ta < n ? pa[8 * k] : 0u;
            qa[k][1] = tb < n ? pb[8 * k] : 0u;
            qa[k][2] = ta < n ? pa[8 * k + 4] : 0u;
            qa[k][3] = tb < n ? pb[8 * k + 4] : 0u;
        }
    }
    float acc[NT][4];
    #pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.f, l_b = 0.f;

    // K/V tiles: [stage][K, V][row * D + chunk * 8], 16-byte chunks swizzled by row for ldmatrix.
    __shared__ __align__(128) T kv[2][2][KT * D];
""" + STAGE_LOAD + """    int stage = 0;
    load(0, start);
    for (int base = start; base < end; base += KT) {
        load(stage ^ 1, base + KT);  // past the end: an all-skipped (zero-filled) group
        cp_async_wait_1();
        __syncthreads();
        const T* kt = kv[stage][0];
        const T* vt = kv[stage][1];
        float s[NJ][4];
        #pragma unroll
        for (int j = 0; j < NJ; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
            const int row = 8 * j + (lane & 7);
            #pragma unroll
            for (int p = 0; p < KS / 2; ++p) {
                unsigned kb[4];
                const int chunk = 4 * p + (lane >> 3);
                ldmatrix_x4(kb, kt + row * D + ((chunk ^ (row & 7)) * 8));
                mma16816_rows(s[j], qa[2 * p], kb[0], kb[1], T{});
                mma16816_rows(s[j], qa[2 * p + 1], kb[2], kb[3], T{});
            }
        }
        // Mask and scale; each row's max over this stage, across the quad that holds the row.
        float mx_a = NEG_INF, mx_b = NEG_INF;
        #pragma unroll
        for (int j = 0; j < NJ; ++j) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = base + 8 * j + 2 * t + e;
                const bool in = key < end;
                const bool see_a = in && key <= pos_a && (WINDOW == 0 || key > pos_a - WINDOW);
                const bool see_b = in && key <= pos_b && (WINDOW == 0 || key > pos_b - WINDOW);
                s[j][e] = see_a ? s[j][e] * sc : NEG_INF;
                s[j][e + 2] = see_b ? s[j][e + 2] * sc : NEG_INF;
                mx_a = fmaxf(mx_a, s[j][e]);
                mx_b = fmaxf(mx_b, s[j][e + 2]);
            }
        }
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffff, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffff, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffff, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffff, mx_b, 2));
        const float na = fmaxf(m_a, mx_a), nb = fmaxf(m_b, mx_b);
        const float ca = na == NEG_INF ? 1.f : __expf(m_a - na);
        const float cb = nb == NEG_INF ? 1.f : __expf(m_b - nb);
        float sum_a = 0.f, sum_b = 0.f;
        #pragma unroll
        for (int j = 0; j < NJ; ++j) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[j][e] = na == NEG_INF ? 0.f : __expf(s[j][e] - na);
                s[j][e + 2] = nb == NEG_INF ? 0.f : __expf(s[j][e + 2] - nb);
                sum_a += s[j][e];
                sum_b += s[j][e + 2];
            }
        }
        l_a = l_a * ca + sum_a;
        l_b = l_b * cb + sum_b;
        m_a = na;
        m_b = nb;
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            acc[j][0] *= ca; acc[j][1] *= ca;
            acc[j][2] *= cb; acc[j][3] *= cb;
        }
        // O += P V, 16 keys a k-step: P's A fragments are S's accumulators of two n-tiles.
        #pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
            const unsigned pa[4] = {pack2(s[2 * kk][0], s[2 * kk][1], T{}), pack2(s[2 * kk][2], s[2 * kk][3], T{}),
                                    pack2(s[2 * kk + 1][0], s[2 * kk + 1][1], T{}),
                                    pack2(s[2 * kk + 1][2], s[2 * kk + 1][3], T{})};
            #pragma unroll
            for (int j = 0; j < NT; j += 2) {
                unsigned vb[4];
                const int row = 16 * kk + ((lane >> 3) & 1) * 8 + (lane & 7);
                const int chunk = j + (lane >> 4);
                ldmatrix_x4_trans(vb, vt + row * D + ((chunk ^ (row & 7)) * 8));
                mma16816_rows(acc[j], pa, vb[0], vb[1], T{});
                mma16816_rows(acc[j + 1], pa, vb[2], vb[3], T{});
            }
        }
        __syncthreads();  // every warp is done with this stage before the next load overwrites it
        stage ^= 1;
    }
    asm volatile("cp.async.wait_all;" ::);
    l_a += __shfl_xor_sync(0xffffffff, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffff, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffff, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffff, l_b, 2);
"""  # noqa: E501 - kernel source text, kept verbatim

WRITE_OUT = """
    // Each thread writes its two rows' elements 8j + 2t and 8j + 2t + 1, normalised, with the sink term.
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int tok = r ? tb : ta;
        if (tok >= n) continue;
        float M = r ? m_b : m_a, L = r ? l_b : l_a, c = 1.f;
        if (SINKS) {
            const float sk = static_cast<float>(sinks[head]);
            if (sk != NEG_INF) {
                const float M2 = fmaxf(M, sk);
                c = M == NEG_INF ? 0.f : __expf(M - M2);
                L = L * c + __expf(sk - M2);
            }
        }
        const float inv = L > 0.f ? c / L : 0.f;
        T* o = out + ((size_t)(q_row + tok) * H + head) * D + 2 * t;
        #pragma unroll
        for (int j = 0; j < NT; ++j)
            *reinterpret_cast<unsigned*>(o + 8 * j) = pack2(acc[j][2 * r] * inv, acc[j][2 * r + 1] * inv, T{});
    }
"""

WRITE_SPLIT = """
    // Partials in decode_attention.MERGE's layout: (splits, tokens, H, D), (splits, tokens, H).
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int tok = r ? tb : ta;
        if (tok >= n) continue;
        const size_t ph = ((size_t)split * q_shape[0] + q_row + tok) * H + head;
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            part_acc[ph * D + 8 * j + 2 * t] = acc[j][2 * r];
            part_acc[ph * D + 8 * j + 2 * t + 1] = acc[j][2 * r + 1];
        }
        if (t == 0) {
            part_m[ph] = r ? m_b : m_a;
            part_l[ph] = r ? l_b : l_a;
        }
    }
"""
