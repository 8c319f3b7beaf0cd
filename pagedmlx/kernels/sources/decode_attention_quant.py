"""Paged decode attention over quantized pages (kv_cache_dtype int8 / int4), in the portable dialect.

The lanes kernel's loop (decode_attention.ACCUMULATE), with its row registers and their loads
replaced: a lane's row registers are QBITS * VEC / 32 packed words of its VEC channels (MLX's affine
packing: channel e in word e * QBITS / 32 at bit QBITS * (e % (32 / QBITS)), low bits first) and two
words that hold its group's scale and bias as float bits; the values are dequantized in the inner
loop (q * scale + bias), where the 16-bit kernel converts its elements to float. quantized_accumulate
makes the loop by exact text replacement, each of which must apply (so a change to the 16-bit loop
that this one does not follow fails loudly instead of building a wrong kernel).
"""

from pagedmlx.kernels.sources import replace_exactly

QUANT_HEADER = """
// Loads one step of quantized K/V rows: per token row, NW - 2 packed words of the lane's channels,
// then its group's scale and bias (as float bits). ok[u]: that token exists (t < end).
template <int U, int NW, int TOK, int BS, int D, int QBITS, int QGROUP, typename PK, typename PS, typename PT>
FUNC void load_qrows(THREAD uint32_t (&kr)[U][NW], THREAD uint32_t (&vr)[U][NW], THREAD bool (&ok)[U],
                     PK k_pages, PK v_pages, PS k_scales, PS k_biases, PS v_scales, PS v_biases, PT table,
                     int kvh, int nkv, int base, int end, int grp, int col) {
    constexpr int WORDS = D * QBITS / 32;
    constexpr int GROUPS = D / QGROUP;
    #pragma unroll
    for (int u = 0; u < U; ++u) {
        const int t = base + u * TOK + grp;
        ok[u] = t < end;
        if (ok[u]) {
            const size_t row = ((size_t)table[t / BS] * nkv + kvh) * BS + (t % BS);
            const size_t w0 = row * WORDS + col * QBITS / 32;
            #pragma unroll
            for (int i = 0; i < NW - 2; ++i) { kr[u][i] = LOAD16(k_pages + w0 + i); vr[u][i] = LOAD16(v_pages + w0 + i); }
            const size_t g = row * GROUPS + col / QGROUP;
            kr[u][NW - 2] = FLOAT_BITS(static_cast<float>(k_scales[g]));
            kr[u][NW - 1] = FLOAT_BITS(static_cast<float>(k_biases[g]));
            vr[u][NW - 2] = FLOAT_BITS(static_cast<float>(v_scales[g]));
            vr[u][NW - 1] = FLOAT_BITS(static_cast<float>(v_biases[g]));
        }
    }
}

// A row's VEC channels as floats: q * scale + bias.
template <int VEC, int NW, int QBITS>
FUNC void dequant_row(THREAD const uint32_t (&r)[NW], THREAD float (&f)[VEC]) {
    constexpr int PER = 32 / QBITS;
    constexpr uint32_t MASK = (1u << QBITS) - 1u;
    const float s = BITS_FLOAT(r[NW - 2]);
    const float b = BITS_FLOAT(r[NW - 1]);
    #pragma unroll
    for (int e = 0; e < VEC; ++e) f[e] = static_cast<float>((r[e / PER] >> (QBITS * (e % PER))) & MASK) * s + b;
}
"""  # noqa: E501 - kernel source text, kept verbatim

_LOAD_ARGS = "k_pages, v_pages, table"
_QLOAD_ARGS = "k_pages, v_pages, k_scales, k_biases, v_scales, v_biases, table"

# (16-bit loop text, quantized loop text, times it occurs)
REPLACEMENTS = [
    ("constexpr int NV = VEC * sizeof(T) / 16;", "constexpr int NV = VEC * QBITS / 32 + 2;", 1),
    ("uint4 kraw[U][NV], vraw[U][NV];", "uint32_t kraw[U][NV], vraw[U][NV];", 1),
    ("uint4 knext[U][NV], vnext[U][NV];", "uint32_t knext[U][NV], vnext[U][NV];", 1),
    ("load_rows<U, NV, TOK, BS, D>(", "load_qrows<U, NV, TOK, BS, D, QBITS, QGROUP>(", 3),
    (_LOAD_ARGS, _QLOAD_ARGS, 3),
    ("""auto kt = reinterpret_cast<THREAD const T*>(kraw[u]);
            float kf[VEC];
            #pragma unroll
            for (int e = 0; e < VEC; ++e) kf[e] = static_cast<float>(kt[e]);""",
     """float kf[VEC];
            dequant_row<VEC, NV, QBITS>(kraw[u], kf);""", 1),
    ("""auto vt = reinterpret_cast<THREAD const T*>(vraw[u]);
                float vf[VEC];
                #pragma unroll
                for (int e = 0; e < VEC; ++e) vf[e] = static_cast<float>(vt[e]);""",
     """float vf[VEC];
                dequant_row<VEC, NV, QBITS>(vraw[u], vf);""", 1),
]


def quantized_accumulate(accumulate: str) -> str:
    """The 16-bit lanes loop made to read quantized rows; raises if a replacement does not apply."""
    return replace_exactly(accumulate, REPLACEMENTS, "decode loop", "sources/decode_attention_quant.py")
