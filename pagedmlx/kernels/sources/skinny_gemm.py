"""A matmul of a few rows (vLLM's skinny GEMMs) in the portable dialect (kernels/dialect.py);
kernels/skinny_gemm.py renders, builds and launches it."""

SKINNY_GEMM = """
    // y (M, N) = x (M, K) @ w^T with w (N, K) row-major, for M of 1 to 8 rows: each SIMD group computes ROWS of
    // y's columns for all M rows, reading each weight row once, 16 bytes a lane a step; x's rows come from cache.
    // Float sums, one rounding to T at the end (as MLX's gemv). T is bfloat16 (8 values a 16-byte load, widened
    // by shifts) or float32 (4).
    constexpr int VEC = 16 / sizeof(T);
    constexpr int STEP = 32 * VEC;
    const int N = w_shape[0];
    const int n0 = (GROUP_X * WARPS + SIMD_ID) * ROWS;
    float acc[M][ROWS];
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.0f;
    }
    for (int k = LANE * VEC; k < K; k += STEP) {
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
    #pragma unroll
    for (int m = 0; m < M; ++m) {
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float s = acc[m][r];
            for (int o = 16; o > 0; o >>= 1) s += SHFL_XOR(s, o);
            if (LANE == r && n0 + r < N) y[(size_t)m * N + n0 + r] = static_cast<T>(s);
        }
    }
"""
