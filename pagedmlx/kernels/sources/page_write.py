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
"""

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
