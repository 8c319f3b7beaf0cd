"""CUDA source of the recurrent-state kernels, as mx.fast.cuda_kernel bodies (kernels/recurrent_state.py
builds and launches them; template parameters and inputs are named there).

- GATED_DELTA: the gated delta rule over a chunk of T tokens (decode: T = 1, a batch of sequences;
  prefill: one sequence), a port of mlx-lm's Metal kernel: one warp per (sequence, value head, value
  row), the row's Dk state columns in the lanes' registers across all T tokens.
- DEPTHWISE_CONV: the short convolution over [conv state; new rows] (groups = channels).
- WRITE_ROWS: state rows written into the pool at their slots, in place.
"""

GATED_DELTA = """
    // q, k: [B, T, Hk, Dk]; v, y: [B, T, Hv, Dv]; g: [B, T, Hv] (or [B, T, Hv, Dk] with VEC_G);
    // beta: [B, T, Hv]; state_in, state_out: [B, Hv, Dv, Dk]. Lane l holds columns [l * NPT, (l + 1) * NPT).
    constexpr int NPT = Dk / 32;
    const int lane = threadIdx.x;
    const int dv = blockIdx.y * blockDim.y + threadIdx.y;
    const int n = blockIdx.z;
    if (dv >= Dv) return;
    const int b = n / Hv, hv = n % Hv, hk = hv / (Hv / Hk);
    const int T = q_shape[1];
    const InT* q_ = q + ((size_t)b * T * Hk + hk) * Dk + lane * NPT;
    const InT* k_ = k + ((size_t)b * T * Hk + hk) * Dk + lane * NPT;
    const InT* v_ = v + ((size_t)b * T * Hv + hv) * Dv + dv;
    InT* y_ = y + ((size_t)b * T * Hv + hv) * Dv + dv;
    const GT* g_ = g + ((size_t)b * T * Hv + hv) * (VEC_G ? Dk : 1) + (VEC_G ? lane * NPT : 0);
    const InT* beta_ = beta + (size_t)b * T * Hv + hv;
    const StT* s_in = state_in + ((size_t)n * Dv + dv) * Dk + lane * NPT;
    StT* s_out = state_out + ((size_t)n * Dv + dv) * Dk + lane * NPT;

    float st[NPT];
    #pragma unroll
    for (int i = 0; i < NPT; ++i) st[i] = static_cast<float>(s_in[i]);
    for (int t = 0; t < T; ++t) {
        float kv_mem = 0.f;
        #pragma unroll
        for (int i = 0; i < NPT; ++i) {
            st[i] *= static_cast<float>(g_[VEC_G ? i : 0]);
            kv_mem += st[i] * static_cast<float>(k_[i]);
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) kv_mem += __shfl_xor_sync(0xffffffff, kv_mem, o);
        const float delta = (static_cast<float>(*v_) - kv_mem) * static_cast<float>(*beta_);
        float out = 0.f;
        #pragma unroll
        for (int i = 0; i < NPT; ++i) {
            st[i] += static_cast<float>(k_[i]) * delta;
            out += st[i] * static_cast<float>(q_[i]);
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) out += __shfl_xor_sync(0xffffffff, out, o);
        if (lane == 0) *y_ = static_cast<InT>(out);
        q_ += Hk * Dk;
        k_ += Hk * Dk;
        v_ += Hv * Dv;
        y_ += Hv * Dv;
        g_ += Hv * (VEC_G ? Dk : 1);
        beta_ += Hv;
    }
    #pragma unroll
    for (int i = 0; i < NPT; ++i) s_out[i] = static_cast<StT>(st[i]);
"""

DEPTHWISE_CONV = """
    // x: [B, L, C] (the conv state's K - 1 rows, then the new rows); weight: [C, K, 1];
    // out: [B, L - K + 1, C], out[b, t, c] = bias[c] + sum_j weight[c, j] * x[b, t + j, c].
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int L = x_shape[1], C = x_shape[2], Lo = L - K + 1;
    if (i >= (size_t)x_shape[0] * Lo * C) return;
    const int c = i % C;
    const size_t bt = i / C;
    const InT* xp = x + ((bt / Lo) * L + bt % Lo) * C + c;
    float acc = HAS_BIAS ? static_cast<float>(bias[c]) : 0.f;
    #pragma unroll
    for (int j = 0; j < K; ++j) acc += static_cast<float>(weight[c * K + j]) * static_cast<float>(xp[(size_t)j * C]);
    out[i] = static_cast<InT>(acc);
"""

WRITE_ROWS = """
    // values: [n, E] -> pool[slots[r], :] for each row r (slot < 0: skip), through the input pointer: the
    // pool is written in place, whoever else references it (see kernels/page_write.py).
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) written[0] = 0;
    if (i >= (size_t)values_shape[0] * E) return;
    const int slot = slots[i / E];
    if (slot < 0) return;
    const_cast<P*>(pool)[(size_t)slot * E + i % E] = values[i];
"""
