"""CUDA source of paged prefill attention over quantized pages (kv_cache_dtype int8 / int4, sm_80+):
prefill_attention_cuda.ACCUMULATE with its K/V stage load replaced. Same tiles, masks, online softmax and
splits; each stage's key rows are read as 16-byte pieces of the packed uint32 pages with their groups'
scales and biases, dequantized (decode_attention_quant_mma_cuda's store_piece: q * scale + bias in the
model's dtype, as the quantized decode kernel does) into the same swizzled shared-memory tiles that ldmatrix
reads. Plain loads, not cp.async: a stage is stored before the barrier that precedes its math (the waits
on the empty cp.async groups cost nothing). quantized_prefill makes the loop by exact text replacement,
each of which must apply.
"""

from pagedmlx.kernels.sources import prefill_attention_cuda as prefill_src
from pagedmlx.kernels.sources import replace_exactly

_QLOAD = """    // A stage's key rows as 16-byte pieces of packed words (PPR a row) and each piece's group's scale and
    // bias, dequantized into the tiles; zeros past the split's end (finite values under masked scores).
    constexpr int WORDS = D * QBITS / 32;
    constexpr int GROUPS = D / QGROUP;
    constexpr int PPR = WORDS / 4;
    auto load = [&](int stage, int base) {
        for (int c = threadIdx.x; c < KT * PPR; c += THREADS) {
            const int row = c / PPR, piece = c % PPR;
            const int key = base + row;
            uint4 kr = make_uint4(0u, 0u, 0u, 0u), vr = kr;
            unsigned ks = 0u, vs = 0u;  // scale (low 16 bits) and bias (high)
            if (key < end) {
                const size_t r = ((size_t)table[(key - key_offset) / BS] * NKV + kvh) * BS + key % BS;
                kr = __ldg(reinterpret_cast<const uint4*>(k_pages + r * WORDS) + piece);
                vr = __ldg(reinterpret_cast<const uint4*>(v_pages + r * WORDS) + piece);
                const size_t gi = r * GROUPS + piece * (128 / QBITS) / QGROUP;
                ks = pair_bits(k_scales[gi], k_biases[gi]);
                vs = pair_bits(v_scales[gi], v_biases[gi]);
            }
            store_piece<T, D, QBITS>(kv[stage][0], row, piece, kr, ks);
            store_piece<T, D, QBITS>(kv[stage][1], row, piece, vr, vs);
        }
        cp_async_commit();
    };
"""

# (16-bit loop text, quantized loop text, times it occurs)
REPLACEMENTS = [
    ("    constexpr int CH = D / 8;  // 16-byte chunks per K/V row\n", "", 1),
    (prefill_src.STAGE_LOAD, _QLOAD, 1),
]


def quantized_prefill(accumulate: str) -> str:
    """prefill_attention_cuda.ACCUMULATE made to read quantized pages; raises if a replacement does not apply."""
    return replace_exactly(accumulate, REPLACEMENTS, "prefill loop", "sources/prefill_attention_quant_cuda.py")
