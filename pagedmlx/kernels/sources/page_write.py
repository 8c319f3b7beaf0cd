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
