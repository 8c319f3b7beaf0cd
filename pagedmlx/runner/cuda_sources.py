"""CUDA source of the paged KV kernels, as mx.fast.cuda_kernel bodies (cuda_decode.py builds and
launches them; template parameters and inputs are named there).

- ACCUMULATE: the decode kernel's main loop on CUDA cores. Lanes work in groups; each group holds one
  token's K/V row in 16-byte vectors, with an online softmax per group.
- cuda_mma_sources.py: the same loop on tensor cores.
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
