"""CUDA source of the paged KV kernels, as mx.fast.cuda_kernel bodies (cuda_decode.py builds and
launches them; template parameters and inputs are named there).

- ACCUMULATE: the decode kernel's main loop on CUDA cores. Lanes work in groups; each group holds one
  token's K/V row in 16-byte vectors, with an online softmax per group.
- ACCUMULATE_MMA (+ MMA_HEADER): the same on tensor cores (mma.sync m16n8k16), K/V tiles of 16 tokens
  staged in shared memory by cp.async.
- MERGE_WARPS, then WRITE_OUT (one split) or WRITE_SPLIT (a split's partials); MERGE: the splits.
- RESHAPE_AND_CACHE: the in-place page write.
"""

HEADER = "#define NEG_INF __int_as_float(0xff800000)\n"

ACCUMULATE = """
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
"""

MERGE_WARPS = """
    // Every warp has stored its partial (sm_m, sm_l: running max and sum per head; sm_acc: the
    // weighted sum of values); merge them per (head, element).
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

WRITE_OUT = """
        out[h * D + d] = static_cast<T>(L > 0.f ? A / L : 0.f);
    }
"""

WRITE_SPLIT = """
        const size_t ph = (size_t)split * gridDim.y * H + h;
        part_acc[ph * D + d] = A;
        if (d == 0) { part_m[ph] = M; part_l[ph] = L; }
    }
"""

MERGE = """
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

RESHAPE_AND_CACHE = """
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
"""

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
    const int start = split * split_tokens[0];
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
"""
