"""Paged decode attention in the portable dialect (kernels/dialect.py), for CUDA and Metal alike;
kernels/decode_attention.py renders, builds and launches it (template parameters and inputs are named there).

- HEADER: helpers (a step's K/V row loads; the sink term).
- ACCUMULATE: the decode kernel's main loop. Lanes work in groups; each group holds one token's
  K/V row in 16-byte vectors, with an online softmax per group. decode_attention_mma_cuda.py has the same
  loop on tensor cores (CUDA only), ending in the same per-SIMD-group partials.
- MERGE_WARPS, then WRITE_OUT (one split: sink term, output) or WRITE_SPLIT (a split's partials);
  MERGE: the splits (sink term, output).

Every sequence's keys are [lo, seq_len) with lo = seq_len - WINDOW under a sliding window (a decode
query at position p = seq_len - 1 sees keys p - WINDOW < j <= p), else 0; split s takes
[lo + s * split_tokens, lo + (s + 1) * split_tokens). With SINKS, head h's learned logit sinks[h]
joins the softmax's denominator with a zero value vector (gpt-oss; as SDPA's `sinks=`).
"""

HEADER = """
// Loads one step of K/V rows: U token rows per group of lanes (TOK groups per SIMD group), NV
// 16-byte vectors per lane; ok[u]: that token exists (t < end).
template <int U, int NV, int TOK, int BS, int D, typename PK, typename PT>
FUNC void load_rows(THREAD uint4 (&kr)[U][NV], THREAD uint4 (&vr)[U][NV], THREAD bool (&ok)[U],
                    PK k_pages, PK v_pages, PT table, int kvh, int nkv, int base, int end, int grp, int col) {
    #pragma unroll
    for (int u = 0; u < U; ++u) {
        const int t = base + u * TOK + grp;
        ok[u] = t < end;
        if (ok[u]) {
            const size_t row = (((size_t)table[t / BS] * nkv + kvh) * BS + (t % BS)) * D + col;
            auto kp = reinterpret_cast<const DEVICE uint4*>(k_pages + row);
            auto vp = reinterpret_cast<const DEVICE uint4*>(v_pages + row);
            #pragma unroll
            for (int i = 0; i < NV; ++i) { kr[u][i] = LOAD16(kp + i); vr[u][i] = LOAD16(vp + i); }
        }
    }
}

// A sink: logit s with a zero value vector, added to a softmax held as running max M, sum L and
// weighted values A (all relative to M).
FUNC void add_sink(THREAD float& M, THREAD float& L, THREAD float& A, float s) {
    if (s == NEG_INF) return;
    const float M2 = FMAX(M, s);
    const float c = M == NEG_INF ? 0.f : EXP(M - M2);
    L = L * c + EXP(s - M2);
    A *= c;
    M = M2;
}
"""

ACCUMULATE = """
    // Lanes work in groups of TPT; each group holds one token's K/V row (VEC elements per lane,
    // read as 16-byte vectors), so a SIMD group has TOK = 32 / TPT tokens in flight per step and
    // U steps' loads issued together. Every lane group keeps its own online-softmax state; groups,
    // then SIMD groups, merge at the end.
    constexpr int NW = THREADS / 32;
    constexpr int TOK = 32 / TPT;
    constexpr int NV = VEC * sizeof(T) / 16;
    SHARED float sm_m[NW * G];
    SHARED float sm_l[NW * G];
    SHARED float sm_acc[NW * G * D];
    const int lane = LANE;
    const int warp = SIMD_ID;
    const int sub = lane % TPT;
    const int grp = lane / TPT;
    // A group of threads serves G query heads of one kv head; R groups share a kv head (R = group / G).
    const int kvh = GROUP_X / R;
    const int b = GROUP_Y;
    const int split = GROUP_Z;
    const int NKV = GROUPS_X / R;
    const int H = GROUPS_X * G;
    const int max_blocks = block_table_shape[1];
    const int seq_len = seq_lens[b];
    const int lo = WINDOW > 0 ? IMAX(0, seq_len - WINDOW) : 0;
    const int start = lo + split * split_tokens[0];
    const int end = IMIN(seq_len, start + split_tokens[0]);
    const float sc = scale[0];

    float qv[G][VEC], acc[G][VEC], m[G], l[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        auto qp = q + ((size_t)b * H + GROUP_X * G + g) * D + sub * VEC;
        #pragma unroll
        for (int e = 0; e < VEC; ++e) { qv[g][e] = static_cast<float>(qp[e]) * sc; acc[g][e] = 0.f; }
        m[g] = NEG_INF; l[g] = 0.f;
    }
    auto table = block_table + (size_t)b * max_blocks;
    constexpr int STEP = NW * TOK * U;
    uint4 kraw[U][NV], vraw[U][NV];
    bool valid[U];
    load_rows<U, NV, TOK, BS, D>(kraw, vraw, valid, k_pages, v_pages, table, kvh, NKV, start + warp * TOK * U,
                                 end, grp, sub * VEC);
    for (int base = start + warp * TOK * U; base < end; base += STEP) {
        // PF: the next U steps' loads are issued before this step's math (twice the registers).
        uint4 knext[U][NV], vnext[U][NV];
        bool valid_next[U];
        if (PF) load_rows<U, NV, TOK, BS, D>(knext, vnext, valid_next, k_pages, v_pages, table, kvh, NKV,
                                             base + STEP, end, grp, sub * VEC);
        // Scores of all U tokens for all G heads first, reduced across the group's lanes together
        // (independent shuffles overlap); then one softmax rescale per head for the U tokens, then
        // the values. Each K/V element is converted to float once, not once per head.
        float s[U][G];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            auto kt = reinterpret_cast<THREAD const T*>(kraw[u]);
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
                for (int g = 0; g < G; ++g) s[u][g] += SHFL_XOR(s[u][g], o);
            }
        }
        // s becomes each token's softmax weight under the new running max (0 for missing tokens).
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            float m_new = m[g];
            #pragma unroll
            for (int u = 0; u < U; ++u) if (valid[u]) m_new = FMAX(m_new, s[u][g]);
            if (m_new == NEG_INF) {
                #pragma unroll
                for (int u = 0; u < U; ++u) s[u][g] = 0.f;
                continue;
            }
            const float corr = EXP(m[g] - m_new);
            l[g] *= corr;
            #pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][e] *= corr;
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                s[u][g] = valid[u] ? EXP(s[u][g] - m_new) : 0.f;
                l[g] += s[u][g];
            }
            m[g] = m_new;
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            if (valid[u]) {
                auto vt = reinterpret_cast<THREAD const T*>(vraw[u]);
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
            load_rows<U, NV, TOK, BS, D>(kraw, vraw, valid, k_pages, v_pages, table, kvh, NKV, base + STEP, end,
                                         grp, sub * VEC);
        }
    }
    // Merge the token groups of this SIMD group (lanes with the same `sub`).
    #pragma unroll
    for (int o = TPT; o < 32; o <<= 1) {
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            const float m2 = SHFL_XOR(m[g], o);
            const float l2 = SHFL_XOR(l[g], o);
            const float M = FMAX(m[g], m2);
            const float c1 = M == NEG_INF ? 0.f : EXP(m[g] - M);
            const float c2 = M == NEG_INF ? 0.f : EXP(m2 - M);
            #pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float a2 = SHFL_XOR(acc[g][e], o);
                acc[g][e] = acc[g][e] * c1 + a2 * c2;
            }
            l[g] = l[g] * c1 + l2 * c2;
            m[g] = M;
        }
    }
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
    // Every SIMD group has stored its partial (sm_m, sm_l: running max and sum per head; sm_acc:
    // the weighted sum of values); merge them per (head, element).
    BARRIER();
    for (int i = THREAD_IN_GROUP; i < G * D; i += THREADS) {
        const int g = i / D, d = i % D;
        float M = NEG_INF;
        for (int w = 0; w < NW; ++w) M = FMAX(M, sm_m[w * G + g]);
        float L = 0.f, A = 0.f;
        if (M != NEG_INF) {
            for (int w = 0; w < NW; ++w) {
                const float c = EXP(sm_m[w * G + g] - M);
                L += sm_l[w * G + g] * c;
                A += sm_acc[(w * G + g) * D + d] * c;
            }
        }
        const int head = GROUP_X * G + g;
        const size_t h = (size_t)b * H + head;
"""

WRITE_OUT = """
        if (SINKS) add_sink(M, L, A, static_cast<float>(sinks[head]));
        out[h * D + d] = static_cast<T>(L > 0.f ? A / L : 0.f);
    }
"""

WRITE_SPLIT = """
        const size_t ph = (size_t)split * GROUPS_Y * H + h;
        part_acc[ph * D + d] = A;
        if (d == 0) { part_m[ph] = M; part_l[ph] = L; }
    }
"""

MERGE = """
    const int h = GROUP_X;
    const int b = GROUP_Y;
    const int d = THREAD_IN_GROUP;
    const int H = GROUPS_X;
    const int B = GROUPS_Y;
    const int splits = part_m_shape[0];
    float M = NEG_INF;
    for (int s = 0; s < splits; ++s) M = FMAX(M, part_m[((size_t)s * B + b) * H + h]);
    float L = 0.f, A = 0.f;
    if (M != NEG_INF) {
        for (int s = 0; s < splits; ++s) {
            const size_t ph = ((size_t)s * B + b) * H + h;
            const float c = EXP(part_m[ph] - M);
            L += part_l[ph] * c;
            A += part_acc[ph * D + d] * c;
        }
    }
    if (SINKS) add_sink(M, L, A, static_cast<float>(sinks[h]));
    out[((size_t)b * H + h) * D + d] = static_cast<T>(L > 0.f ? A / L : 0.f);
"""
