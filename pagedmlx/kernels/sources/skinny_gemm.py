"""A matmul of a few rows (vLLM's skinny GEMMs) in the portable dialect (kernels/dialect.py);
kernels/skinny_gemm.py renders, builds and launches it."""

SKINNY_GEMM = """
    // y (M, N) = x (M, K) @ w^T with w (N, K) row-major, for M of 1 to 8 rows: SPLIT SIMD groups of a thread
    // group compute ROWS of y's columns for all M rows, each every SPLIT-th step of K (narrow products: more SIMD
    // groups in flight), reading each weight row once, 16 bytes a lane a step; x's rows come from cache. Float
    // sums, added across the SPLIT groups in threadgroup memory, one rounding to T at the end (as MLX's gemv).
    // T is bfloat16 (8 values a 16-byte load, widened by shifts) or float32 (4).
    constexpr int VEC = 16 / sizeof(T);
    constexpr int STEP = 32 * VEC * SPLIT;
    const int N = w_shape[0];
    const int part = SIMD_ID % SPLIT;
    const int n0 = (GROUP_X * (WARPS / SPLIT) + SIMD_ID / SPLIT) * ROWS;
    float acc[M][ROWS];
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.0f;
    }
    for (int k = (part * 32 + LANE) * VEC; k < K; k += STEP) {
        float wf[ROWS][VEC];
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int n = IMIN(n0 + r, N - 1);  // rows past N repeat the last; not written
            const uint4 v = *reinterpret_cast<const DEVICE uint4*>(w + (size_t)n * K + k);
            const unsigned words[4] = {v.x, v.y, v.z, v.w};
            #pragma unroll
            for (int j = 0; j < VEC; ++j) {
                wf[r][j] = VEC == 8 ? BITS_FLOAT((j & 1) ? (words[j >> 1] & 0xffff0000u) : (words[j >> 1] << 16))
                                    : BITS_FLOAT(words[j & 3]);
            }
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            const uint4 v = *reinterpret_cast<const DEVICE uint4*>(x + (size_t)m * K + k);
            const unsigned words[4] = {v.x, v.y, v.z, v.w};
            #pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float xv = VEC == 8 ? BITS_FLOAT((j & 1) ? (words[j >> 1] & 0xffff0000u) : (words[j >> 1] << 16))
                                          : BITS_FLOAT(words[j & 3]);
                #pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[m][r] += xv * wf[r][j];
            }
        }
    }
    SHARED float parts[WARPS][M][ROWS];
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float s = acc[m][r];
            for (int o = 16; o > 0; o >>= 1) s += SHFL_XOR(s, o);
            if (SPLIT == 1 && LANE == r && n0 + r < N) y[(size_t)m * N + n0 + r] = static_cast<T>(s);
            if (SPLIT > 1 && LANE == r) parts[SIMD_ID][m][r] = s;
        }
    }
    if (SPLIT > 1) {
        BARRIER();
        if (part == 0 && LANE < ROWS && n0 + LANE < N) {
            for (int m = 0; m < M; ++m) {
                float s = 0.0f;
                for (int p = 0; p < SPLIT; ++p) s += parts[SIMD_ID + p][m][LANE];
                y[(size_t)m * N + n0 + LANE] = static_cast<T>(s);
            }
        }
    }
"""
