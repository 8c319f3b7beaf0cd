"""Batched LoRA (vLLM's punica BGMV shrink and expand, fused) in the portable dialect (kernels/dialect.py);
kernels/lora.py renders, builds and launches it."""

ADD_LORA = """
    // One group of 256 threads per (row, tile of 256 * COLS output columns). The row's slot s picks
    // its adapter; slot 0 (no adapter) copies the base output. Shrink: a[r] = x . A[s, r] for r < R,
    // each warp a rank at a time (recomputed by each tile of the row: R * IN multiply-adds, read
    // from cache), rounded to the activations' type as mlx-lm's x @ lora_a is. Expand and add, COLS
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
    SHARED float a_sh[R];
    auto xr = x + (size_t)t * IN;
    for (int r = SIMD_ID; r < R; r += 8) {
        auto ar = lora_a + ((size_t)s * R + r) * IN;
        float acc = 0.0f;
        for (int i = LANE; i < IN; i += 32) acc += static_cast<float>(xr[i]) * static_cast<float>(ar[i]);
        for (int m = 16; m > 0; m >>= 1) acc += SHFL_XOR(acc, m);
        if (LANE == 0) a_sh[r] = static_cast<float>(static_cast<T>(acc));
    }
    BARRIER();
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
