"""CUDA source of moe_align (kernels/fused_moe.py), vLLM's moe_align_block_size in one thread block: a step's
(token, expert) pairs grouped by expert into blocks of BR slots for the fused MoE product (GROUPED_ROWS of
sources/quantized_gemm_cuda.py). Each expert's pairs fill its blocks from their first slot; the order of pairs inside
an expert's blocks follows the atomics, which changes no result (each row of the product is computed alone)."""

MOE_ALIGN = """
    // Template: E (experts), BR (slots a block), K (experts a token), THREADS (one block of them).
    // indices (P,): each pair's expert, pair p = t * K + j. Outputs: ids, token_rows, pair_rows (NB * BR,),
    // block_experts (NB,), NB = ceil(P / BR) + min(E, P): enough blocks for any routing.
    const int P = indices_shape[0], NB = (P + BR - 1) / BR + IMIN(E, P), tid = THREAD_IN_GROUP;
    SHARED int counts[E];
    SHARED int first_block[E];
    SHARED int cursor[E];
    for (int e = tid; e < E; e += THREADS) counts[e] = 0;
    for (int s = tid; s < NB * BR; s += THREADS) {
        ids[s] = -1;
        token_rows[s] = 0;
        pair_rows[s] = 0;
    }
    for (int b = tid; b < NB; b += THREADS) block_experts[b] = -1;
    BARRIER();
    for (int p = tid; p < P; p += THREADS) atomicAdd(&counts[(int)indices[p]], 1);
    BARRIER();
    if (tid == 0) {
        int block = 0;
        for (int e = 0; e < E; ++e) {
            first_block[e] = block;
            cursor[e] = block * BR;
            block += (counts[e] + BR - 1) / BR;
        }
    }
    BARRIER();
    for (int e = tid; e < E; e += THREADS)
        for (int j = 0; j < (counts[e] + BR - 1) / BR; ++j) block_experts[first_block[e] + j] = e;
    for (int p = tid; p < P; p += THREADS) {
        const int slot = atomicAdd(&cursor[(int)indices[p]], 1);
        ids[slot] = p;
        pair_rows[slot] = p;
        token_rows[slot] = p / K;
    }
"""
