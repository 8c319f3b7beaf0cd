"""CUDA source of the paged-decode loop on tensor cores (sm_80+), a drop-in for decode_attention.ACCUMULATE:
per 16-token tile, scores and weighted values by mma.sync m16n8k16, K/V tiles staged in shared memory by
cp.async. MMA_HEADER holds the PTX helpers; ACCUMULATE_MMA ends with the same per-warp partials
(sm_m, sm_l, sm_acc) that decode_attention.MERGE_WARPS merges. CUDA only, but rendered through the
dialect for CUDA like the rest (NEG_INF), and it takes the same window (keys from lo) and sinks.
"""

MMA_HEADER = r"""
// Tensor-core helpers (sm_80+): bf16/fp16 pairs, mma.sync m16n8k16 with float accumulators,
// ldmatrix from shared memory, cp.async from global to shared memory (zero-filled when skipped).
__device__ inline unsigned pack2(float a, float b, __nv_bfloat16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<unsigned*>(&v);
}
__device__ inline unsigned pack2(float a, float b, __half) {
    __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<unsigned*>(&v);
}
// d += A (16 x 16, rows 8..15 zero) * B (16 x 8): a0 = A[g][2t..2t+1], a2 = A[g][2t+8..2t+9];
// b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][...].
__device__ inline void mma16816(float (&d)[4], unsigned a0, unsigned a2, unsigned b0, unsigned b1, __nv_bfloat16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}
__device__ inline void mma16816(float (&d)[4], unsigned a0, unsigned a2, unsigned b0, unsigned b1, __half) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}
// The same with D's rows 8..15 (zero) dropped: written to d[2..3] from zero C registers and never read, so no
// registers are held for them across the loop. Quantized pages' loop only: ptxas gives the 16-bit loop 10
// more instructions with it and no register it needs.
__device__ inline void mma16816_top(float (&d)[4], unsigned a0, unsigned a2, unsigned b0, unsigned b1, __nv_bfloat16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%10,%10};\n"
                 : "+f"(d[0]), "+f"(d[1]), "=f"(d[2]), "=f"(d[3]) : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.f));
}
__device__ inline void mma16816_top(float (&d)[4], unsigned a0, unsigned a2, unsigned b0, unsigned b1, __half) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%10,%10};\n"
                 : "+f"(d[0]), "+f"(d[1]), "=f"(d[2]), "=f"(d[3]) : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.f));
}
__device__ inline void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ inline void cp_async16(void* dst, const void* src, bool valid) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(a), "l"(src), "r"(valid ? 16 : 0));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ inline void cp_async_wait_1() { asm volatile("cp.async.wait_group 1;\n" ::); }
template <int N> __device__ inline void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }
"""  # noqa: E501 - kernel source text, kept verbatim

ACCUMULATE_MMA = """
    // Tensor cores: per 16-token tile a warp computes S = Q K^T as a 16 x 16 (heads x tokens) tile
    // (heads padded from G to 16 rows: the zero rows cost tensor-core time only) and O += P V, with
    // the online softmax on S's accumulators in between (they are P's A fragments as they stand).
    // K/V tiles go global -> shared memory by cp.async, two stages per warp, 16-byte chunks swizzled
    // by row so that ldmatrix reads them without bank conflicts. Warps take tiles in turn.
    constexpr int NW = THREADS / 32;
    constexpr int CH = D / 8;  // 16-byte chunks per row
    constexpr int KS = D / 16;  // k-steps of QK
    constexpr int NT = D / 8;  // n-tiles of PV
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int kvh = blockIdx.x;
    const int b = blockIdx.y;
    const int split = blockIdx.z;
    const int NKV = gridDim.x;
    const int H = NKV * G;
    const int max_blocks = block_table_shape[1];
    const int seq_len = seq_lens[b];
    const int lo = WINDOW > 0 ? max(0, seq_len - WINDOW) : 0;
    const int start = lo + split * split_tokens[0];
    const int end = min(seq_len, start + split_tokens[0]);
    const float sc = scale[0];
    const int* table = block_table + (size_t)b * max_blocks;

    // Q as A fragments: row g (head kvh * G + g, zero past G), dims 16k + 2t (+8).
    unsigned qa[KS][2];
    #pragma unroll
    for (int k = 0; k < KS; ++k) {
        if (g < G) {
            const unsigned* qp = reinterpret_cast<const unsigned*>(q + ((size_t)b * H + kvh * G + g) * D + 16 * k + 2 * t);
            qa[k][0] = qp[0];
            qa[k][1] = qp[4];
        } else {
            qa[k][0] = qa[k][1] = 0u;
        }
    }
    float acc[NT][4];
    #pragma unroll
    for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float m = NEG_INF, l = 0.f;

    __shared__ __align__(128) T tiles[NW][2][2][16 * D];  // [warp][stage][K, V][row * D + chunk * 8]
    auto load = [&](int stage, int tile) {
        #pragma unroll
        for (int i = 0; i < 16 * CH / 32; ++i) {
            const int c = lane + 32 * i, row = c / CH, chunk = c % CH;
            const int tok = tile + row;
            const bool ok = tok < end;
            const size_t src = ok ? (((size_t)table[tok / BS] * NKV + kvh) * BS + tok % BS) * D + chunk * 8 : 0;
            const int dst = row * D + ((chunk ^ (row & 7)) * 8);
            cp_async16(&tiles[warp][stage][0][dst], k_pages + src, ok);
            cp_async16(&tiles[warp][stage][1][dst], v_pages + src, ok);
        }
        cp_async_commit();
    };
    constexpr int STEP = NW * 16;
    int stage = 0;
    load(0, start + warp * 16);
    for (int tile = start + warp * 16; tile < end; tile += STEP) {
        load(stage ^ 1, tile + STEP);  // past the end: an all-skipped (zero-filled) group
        cp_async_wait_1();
        __syncwarp();
        const T* kt = tiles[warp][stage][0];
        const T* vt = tiles[warp][stage][1];
        // S: two n-tiles of 8 tokens; B fragments of K for two k-steps per ldmatrix.x4.
        float s[2][4];
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
            const int row = 8 * j + (lane & 7);
            #pragma unroll
            for (int p = 0; p < KS / 2; ++p) {
                unsigned kb[4];
                const int chunk = 4 * p + (lane >> 3);
                ldmatrix_x4(kb, kt + row * D + ((chunk ^ (row & 7)) * 8));
                mma16816(s[j], qa[2 * p][0], qa[2 * p][1], kb[0], kb[1], T{});
                mma16816(s[j], qa[2 * p + 1][0], qa[2 * p + 1][1], kb[2], kb[3], T{});
            }
        }
        // Online softmax over row g's four tokens here (8j + 2t + e), then across the quad.
        float mx = NEG_INF;
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[j][e] = tile + 8 * j + 2 * t + e < end ? s[j][e] * sc : NEG_INF;
                mx = fmaxf(mx, s[j][e]);
            }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_new = fmaxf(m, mx);
        const float corr = m_new == NEG_INF ? 1.f : __expf(m - m_new);
        float p[2][2];
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) p[j][e] = m_new == NEG_INF ? 0.f : __expf(s[j][e] - m_new);
        }
        l = l * corr + p[0][0] + p[0][1] + p[1][0] + p[1][1];
        m = m_new;
        const unsigned pa0 = pack2(p[0][0], p[0][1], T{}), pa2 = pack2(p[1][0], p[1][1], T{});
        // O += P V: B fragments of V (tokens x dims, transposed by ldmatrix) for two n-tiles at a time.
        #pragma unroll
        for (int n = 0; n < NT; n += 2) {
            unsigned vb[4];
            const int row = ((lane >> 3) & 1) * 8 + (lane & 7);
            const int chunk = n + (lane >> 4);
            ldmatrix_x4_trans(vb, vt + row * D + ((chunk ^ (row & 7)) * 8));
            acc[n][0] *= corr; acc[n][1] *= corr;
            acc[n + 1][0] *= corr; acc[n + 1][1] *= corr;
            mma16816(acc[n], pa0, pa2, vb[0], vb[1], T{});
            mma16816(acc[n + 1], pa0, pa2, vb[2], vb[3], T{});
        }
        __syncwarp();  // every lane is done with this stage before the next load overwrites it
        stage ^= 1;
    }
    asm volatile("cp.async.wait_all;" ::);
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    __shared__ float sm_m[NW * G];
    __shared__ float sm_l[NW * G];
    __shared__ float sm_acc[NW * G * D];
    if (g < G) {
        #pragma unroll
        for (int n = 0; n < NT; ++n) {
            sm_acc[(warp * G + g) * D + 8 * n + 2 * t] = acc[n][0];
            sm_acc[(warp * G + g) * D + 8 * n + 2 * t + 1] = acc[n][1];
        }
        if (t == 0) { sm_m[warp * G + g] = m; sm_l[warp * G + g] = l; }
    }
"""  # noqa: E501 - kernel source text, kept verbatim
