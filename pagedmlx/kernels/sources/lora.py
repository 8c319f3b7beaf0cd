"""Batched LoRA (vLLM's punica BGMV shrink and expand, fused) in the portable dialect (kernels/dialect.py);
kernels/lora.py renders it after a prelude for the number of sibling projections a launch takes, builds
and launches it."""

HEADER = """
// V elements of type T at p, as floats: one 16-byte load where V elements fill one (the host passes
// V = 1 for a width that would misalign rows), else V loads.
template <typename T, int V, typename P>
FUNC void load_elems(THREAD float (&f)[V], P p) {
    if (V * (int)sizeof(T) == 16) {
        const uint4 raw = LOAD16(reinterpret_cast<const DEVICE uint4*>(p));
        auto e = reinterpret_cast<THREAD const T*>(&raw);
        #pragma unroll
        for (int k = 0; k < V; ++k) f[k] = static_cast<float>(e[k]);
    } else {
        #pragma unroll
        for (int k = 0; k < V; ++k) f[k] = static_cast<float>(p[k]);
    }
}
"""

ADD_LORA = """
    // One group of 256 threads per (row, tile of CHUNK output columns of one projection). The prelude
    // (kernels/lora.py: lora_prelude) picks the projection `m` of the group's tile among the launch's
    // siblings (projections of one input: q/k/v, gate/up) and names its y, out, lora_a, lora_b, OUT,
    // CHUNK, tile, and y's row width YS and first column YOFF (OUT and 0 unless y is a merged product). The row's slot s picks its adapter; slot 0 (no adapter) copies the base output.
    // Reads are VIN / VOUT elements a load (16 bytes where the widths allow), so that a thread has 16
    // such loads in flight: at 2 bytes a load this kernel was bound by the latency of L2, not its bandwidth.
    const int t = GROUP_Y;
    const int lo = tile * CHUNK;
    const int hi = IMIN(OUT, lo + CHUNK);
    const int s = indices[t];
    auto yr = y + (size_t)t * YS + YOFF;  // the base output: its own array, or a part of a merged product
    auto outr = out + (size_t)t * OUT;
    if (s == 0) {
        for (int o = lo + THREAD_IN_GROUP; o < hi; o += 256) outr[o] = yr[o];
        return;  // the whole group: s is the row's
    }
    // Shrink, 16 ranks at a time: a[r] = x . A[s, r] (recomputed by each tile of the row, from L2),
    // rounded to the activations' type as mlx-lm's x @ lora_a is. Each thread takes VIN elements of
    // every 256 * VIN for all 16 ranks, then the sums are reduced over each warp's lanes and the 8 warps.
    SHARED float part[8 * 16];
    SHARED float a_sh[R];
    auto xr = x + (size_t)t * IN;
    auto as = lora_a + (size_t)s * R * IN;
    for (int r0 = 0; r0 < R; r0 += 16) {
        float acc[16];
        #pragma unroll
        for (int j = 0; j < 16; ++j) acc[j] = 0.0f;
        for (int i = THREAD_IN_GROUP * VIN; i < IN; i += 256 * VIN) {
            float xv[VIN];
            load_elems<T, VIN>(xv, xr + i);
            #pragma unroll
            for (int j = 0; j < 16; ++j) {
                if (r0 + j < R) {
                    float av[VIN];
                    load_elems<T, VIN>(av, as + (size_t)(r0 + j) * IN + i);
                    #pragma unroll
                    for (int k = 0; k < VIN; ++k) acc[j] += xv[k] * av[k];
                }
            }
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
    // Expand and add, VOUT columns a thread every 256 * VOUT: out = y + scale[s] * (a @ B[s]), rounded
    // step by step as mlx-lm's LoRALinear.
    const float scale = scales[s];
    auto br = lora_b + (size_t)s * R * OUT;
    for (int o = lo + THREAD_IN_GROUP * VOUT; o < hi; o += 256 * VOUT) {
        float yv[VOUT], z[VOUT];
        load_elems<T, VOUT>(yv, yr + o);  // issued with B's loads (after the stores it would wait for them)
        #pragma unroll
        for (int k = 0; k < VOUT; ++k) z[k] = 0.0f;
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            float bv[VOUT];
            load_elems<T, VOUT>(bv, br + (size_t)r * OUT + o);
            #pragma unroll
            for (int k = 0; k < VOUT; ++k) z[k] += a_sh[r] * bv[k];
        }
        #pragma unroll
        for (int k = 0; k < VOUT; ++k) {
            const float w = static_cast<float>(static_cast<T>(scale * static_cast<float>(static_cast<T>(z[k]))));
            outr[o + k] = static_cast<T>(yv[k] + w);
        }
    }
"""  # noqa: E501 - kernel source text, kept verbatim
