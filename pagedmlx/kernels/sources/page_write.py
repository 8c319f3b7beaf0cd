"""The page write (vLLM's reshape_and_cache) in the portable dialect (kernels/dialect.py), for CUDA
and Metal alike; kernels/page_write.py renders, builds and launches it."""

RESHAPE_AND_CACHE = """
    // One thread per (token, kv head, element): keys (T, NKV, DK) and values (T, NKV, DV) go to
    // pages[slot / BS, kv head, slot % BS, :], written in place (see kernels/page_write.py).
    const size_t i = GLOBAL_THREAD;
    if (i == 0) written[0] = 0;
    constexpr int DM = DK > DV ? DK : DV;
    const size_t t = i / (NKV * DM);
    if (t >= (size_t)keys_shape[0]) return;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const int h = (i / DM) % NKV, d = i % DM;
    const size_t page_row = ((size_t)(slot / BS) * NKV + h) * BS + slot % BS;
    if (d < DK) const_cast<DEVICE P*>(k_pages)[page_row * DK + d] = static_cast<P>(static_cast<float>(keys[(t * NKV + h) * DK + d]));
    if (d < DV) const_cast<DEVICE P*>(v_pages)[page_row * DV + d] = static_cast<P>(static_cast<float>(values[(t * NKV + h) * DV + d]));
"""  # noqa: E501 - kernel source text, kept verbatim

RESHAPE_AND_CACHE_QUANT = """
    // A quantized layer's page write: mx.quantize's parts of the step's new rows (packed words
    // (T, NKV, KW / VW), scales and biases (T, NKV, KG / VG)) copied to their slots bit for bit (the
    // words are no floats: no cast), one thread per (token, kv head, word of the widest part).
    const size_t i = GLOBAL_THREAD;
    if (i == 0) written[0] = 0;
    constexpr int WM = KW > VW ? KW : VW;  // >= the groups: a word holds >= 4 channels, a group >= 32
    const size_t t = i / (NKV * WM);
    if (t >= (size_t)slot_mapping_shape[0]) return;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const int h = (i / WM) % NKV, d = i % WM;
    const size_t row = ((size_t)(slot / BS) * NKV + h) * BS + slot % BS, src = t * NKV + h;
    if (d < KW) const_cast<DEVICE uint32_t*>(k_pages)[row * KW + d] = k_q[src * KW + d];
    if (d < VW) const_cast<DEVICE uint32_t*>(v_pages)[row * VW + d] = v_q[src * VW + d];
    if (d < KG) {
        const_cast<DEVICE S*>(k_scales)[row * KG + d] = k_s[src * KG + d];
        const_cast<DEVICE S*>(k_biases)[row * KG + d] = k_b[src * KG + d];
    }
    if (d < VG) {
        const_cast<DEVICE S*>(v_scales)[row * VG + d] = v_s[src * VG + d];
        const_cast<DEVICE S*>(v_biases)[row * VG + d] = v_b[src * VG + d];
    }
"""

RESHAPE_AND_CACHE_QUANTIZING = """
    // A quantized layer's page write that quantizes the step's new rows itself (no mx.quantize launches
    // before it): keys (T, NKV, 1, DK) and values (T, NKV, 1, DV) in KT go to their slots as packed words,
    // scales and biases in S, with the arithmetic of MLX's GPU affine_quantize (CUDA's and Metal's, read
    // from their 0.32 sources): the group's min and max (the max starting at 0), a scale that puts one
    // edge of the range on an integer, and each value rounded half away from zero. kernels/page_write.py
    // checks the result against mx.quantize on the device, bit for bit, before it is used.
    // One SIMD group (warp) per (token, kv head, group of GS channels), keys' groups then values'; each
    // lane holds GS / 32 channels; the first GS * BITS / 32 lanes then pack one word each.
    constexpr int KG = DK / GS, VG = DV / GS, G = KG + VG, VPL = GS / 32, VPW = 32 / BITS, WPG = GS * BITS / 32;
    constexpr float N_BINS = (1 << BITS) - 1;
    const size_t i = GLOBAL_THREAD;
    if (i == 0) written[0] = 0;
    const size_t warp = i / 32;
    const size_t t = warp / (NKV * G);
    if (t >= (size_t)slot_mapping_shape[0]) return;  // the whole warp: t is the warp's
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const int h = (warp / G) % NKV, g = warp % G;
    const bool is_k = g < KG;
    const int gi = is_k ? g : g - KG, dim = is_k ? DK : DV;
    auto src = (is_k ? keys : values) + (t * NKV + h) * dim + gi * GS;
    float w[VPL];
    float w_min = BITS_FLOAT(0x7f7fffffu), w_max = 0.0f;
    #pragma unroll
    for (int j = 0; j < VPL; ++j) {
        w[j] = static_cast<float>(static_cast<S>(static_cast<float>(src[LANE * VPL + j])));  // mx.quantize reads S
        w_min = FMIN(w_min, w[j]);
        w_max = FMAX(w_max, w[j]);
    }
    for (int m = 16; m > 0; m >>= 1) {
        w_min = FMIN(w_min, SHFL_XOR(w_min, m));
        w_max = FMAX(w_max, SHFL_XOR(w_max, m));
    }
    float scale = FMAX((w_max - w_min) / N_BINS, 1e-7f);
    const bool side = FABS(w_min) > FABS(w_max);
    scale = side ? scale : -scale;
    const float edge = side ? w_min : w_max;
    const float q0 = ROUND(edge / scale);
    const bool at_zero = q0 == 0.0f;
    scale = at_zero ? scale : edge / q0;
    const float bias = at_zero ? 0.0f : edge;
    const size_t row = ((size_t)(slot / BS) * NKV + h) * BS + slot % BS;
    if (LANE == 0) {
        const_cast<DEVICE S*>(is_k ? k_scales : v_scales)[row * (dim / GS) + gi] = static_cast<S>(scale);
        const_cast<DEVICE S*>(is_k ? k_biases : v_biases)[row * (dim / GS) + gi] = static_cast<S>(bias);
    }
    if (LANE < WPG) {  // the word's values are other lanes': read again (from L1)
        uint32_t word = 0;
        #pragma unroll
        for (int j = 0; j < VPW; ++j) {
            const float v = static_cast<float>(static_cast<S>(static_cast<float>(src[LANE * VPW + j])));
            const uint8_t q = FMIN(ROUND((v - bias) / scale), N_BINS);
            word |= static_cast<uint32_t>(q) << (BITS * j);
        }
        const_cast<DEVICE uint32_t*>(is_k ? k_pages : v_pages)[row * (dim * BITS / 32) + gi * WPG + LANE] = word;
    }
"""
