"""The residual add fused with the RMSNorm after it (vLLM's fused_add_rms_norm) in the portable dialect
(kernels/dialect.py); kernels/add_rms_norm.py renders, builds and launches it."""

ADD_RMS_NORM = """
    // One group of 256 threads per row: h = x + r (rounded to T, as MLX's add), then
    // y = w * T(h * rsqrt(mean(h^2) + eps)) with MLX's rms_norm arithmetic (float sums, the normalized
    // value rounded to T before the weight's product). Each thread keeps its PER elements of h in registers.
    constexpr int PER = (D + 255) / 256;
    const size_t row = (size_t)GROUP_X * D;
    const int tid = THREAD_IN_GROUP;
    float v[PER];
    float acc = 0.0f;
    #pragma unroll
    for (int k = 0; k < PER; ++k) {
        const int d = tid + 256 * k;
        v[k] = 0.0f;
        if (d < D) {
            const T s = static_cast<T>(static_cast<float>(x[row + d]) + static_cast<float>(r[row + d]));
            h[row + d] = s;
            v[k] = static_cast<float>(s);
            acc += v[k] * v[k];
        }
    }
    SHARED float part[8];
    for (int m = 16; m > 0; m >>= 1) acc += SHFL_XOR(acc, m);
    if (LANE == 0) part[SIMD_ID] = acc;
    BARRIER();
    float total = 0.0f;
    #pragma unroll
    for (int k = 0; k < 8; ++k) total += part[k];
    const float normalizer = RSQRT(total / D + eps[0]);
    #pragma unroll
    for (int k = 0; k < PER; ++k) {
        const int d = tid + 256 * k;
        if (d < D) y[row + d] = static_cast<T>(static_cast<float>(w[d]) * static_cast<float>(static_cast<T>(v[k] * normalizer)));
    }
"""  # noqa: E501 - kernel source text, kept verbatim
