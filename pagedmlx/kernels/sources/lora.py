"""Batched LoRA (vLLM's punica BGMV shrink and expand, fused) in the portable dialect (kernels/dialect.py);
kernels/lora.py renders, builds and launches it."""

ADD_LORA = """
    // One group of 256 threads per (row, tile of 256 * COLS output columns). The row's slot s picks
    // its adapter; slot 0 (no adapter) copies the base output. Shrink: a[r] = x . A[s, r] for r < R
    // (recomputed by each tile of the row: R * IN multiply-adds, read from cache), rounded to the
    // activations' type as mlx-lm's x @ lora_a is. Expand and add, COLS
    // columns a thread 256 apart: out = y + scale[s] * (a @ B[s]), rounded step by step as mlx-lm's
    // LoRALinear.
    const int t = GROUP_Y;
    const int o0 = GROUP_X * (256 * COLS) + THREAD_IN_GROUP;
    const int s = indices[t];
    auto yr = y + (size_t)t * OUT;
    auto outr = out + (size_t)t * OUT;
    if (s == 0) {
        for (int j = 0; j < COLS && o0 + j * 256 < OUT; ++j) outr[o0 + j * 256] = yr[o0 + j * 256];
        return;  // the whole group: s is the row's
    }
    // Shrink, 16 ranks at a time: each thread takes every 256th element of the row for all 16 ranks
    // (16 independent loads an element in flight, not one dependent chain a warp), then the sums are
    // reduced over each warp's lanes and the 8 warps.
    SHARED float part[8 * 16];
    SHARED float a_sh[R];
    auto xr = x + (size_t)t * IN;
    auto as = lora_a + (size_t)s * R * IN;
    for (int r0 = 0; r0 < R; r0 += 16) {
        float acc[16];
        #pragma unroll
        for (int j = 0; j < 16; ++j) acc[j] = 0.0f;
        for (int i = THREAD_IN_GROUP; i < IN; i += 256) {
            const float xv = static_cast<float>(xr[i]);
            #pragma unroll
            for (int j = 0; j < 16; ++j)
                if (r0 + j < R) acc[j] += xv * static_cast<float>(as[(size_t)(r0 + j) * IN + i]);
        }
        #pragma unroll
        for (int j = 0; j < 16; ++j)
            for (int m = 16; m > 0; m >>= 1) acc[j] += SHFL_XOR(acc[j], m);
        if (LANE == 0) {
            #pragma unroll
            for (int j = 0; j < 16; ++j) part[SIMD_ID * 16 + j] = acc[j];
        }
        BARRIER();
        if (THREAD_IN_GROUP < 16 && r0 + THREAD_IN_GROUP < R) {
            float a = 0.0f;
            for (int w = 0; w < 8; ++w) a += part[w * 16 + THREAD_IN_GROUP];
            a_sh[r0 + THREAD_IN_GROUP] = static_cast<float>(static_cast<T>(a));
        }
        BARRIER();
    }
    const float scale = scales[s];
    auto br = lora_b + (size_t)s * R * OUT;
    for (int j = 0; j < COLS && o0 + j * 256 < OUT; ++j) {
        const int o = o0 + j * 256;
        float z = 0.0f;
        for (int r = 0; r < R; ++r) z += a_sh[r] * static_cast<float>(br[(size_t)r * OUT + o]);
        const float w = static_cast<float>(static_cast<T>(scale * static_cast<float>(static_cast<T>(z))));
        outr[o] = static_cast<T>(static_cast<float>(yr[o]) + w);
    }
"""
