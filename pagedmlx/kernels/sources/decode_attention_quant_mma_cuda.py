"""CUDA source of the paged-decode loop on tensor cores over quantized pages (kv_cache_dtype int8 / int4,
sm_80+): decode_attention_mma_cuda.ACCUMULATE_MMA with its K/V tile loads replaced. Same tiling, online
softmax and per-warp partials; a tile's rows are read from the packed uint32 pages and their groups'
scales and biases, dequantized in fp32 (q * scale + bias, rounded to T as mx.dequantize's output is) and
stored into the same swizzled shared-memory tile that ldmatrix reads. Plain loads, not cp.async: for
D <= 128 the next tile's packed words are loaded into registers before this tile's math (a
register-staged pipeline, one shared-memory stage); D = 256 loads each tile where it is used (its
accumulators leave no registers for a second tile).

A lane loads 16-byte pieces of a row's packed words (16 int8 or 32 int4 channels, inside one group:
groups are >= 32 channels) and the piece's group's scale and bias. quantized_accumulate_mma makes the
loop by exact text replacement, each of which must apply (as sources/decode_attention_quant.py does).
"""

QUANT_MMA_HEADER = r"""
// One 16-byte piece of a quantized row (channels 128 / QBITS * piece on) dequantized into the
// swizzled tile: chunk c (8 channels) of row r at r * D + ((c ^ (r & 7)) * 8), as load() stores it.
// A scale and a bias (16-bit floats) in one register: scale in the low half.
template <typename T>
__device__ inline unsigned pair_bits(T scale, T bias) {
    unsigned short s, b;
    memcpy(&s, &scale, 2);
    memcpy(&b, &bias, 2);
    return unsigned(s) | (unsigned(b) << 16);
}
template <typename T>
__device__ inline float half_float(unsigned short bits) {
    T x;
    memcpy(&x, &bits, 2);
    return static_cast<float>(x);
}

template <typename T, int D, int QBITS>
__device__ inline void store_piece(T* tile, int row, int piece, uint4 raw, unsigned scale_bias) {
    constexpr int PER = 32 / QBITS;
    constexpr int CPP = 128 / QBITS / 8;  // 8-channel chunks per piece: 2 (int8), 4 (int4)
    constexpr unsigned MASK = (1u << QBITS) - 1u;
    const float s = half_float<T>(scale_bias & 0xFFFF), b = half_float<T>(scale_bias >> 16);
    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
    #pragma unroll
    for (int j = 0; j < CPP; ++j) {
        unsigned h[4];
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            // q as a float without I2F (a quarter-rate instruction): 2^23 + q has q in its low mantissa bits,
            // and (2^23 + q) - 2^23 is q exactly.
            const int c0 = 8 * j + 2 * e, c1 = c0 + 1;
            const float q0 = __uint_as_float(((w[c0 / PER] >> (QBITS * (c0 % PER))) & MASK) | 0x4B000000u) - 8388608.f;
            const float q1 = __uint_as_float(((w[c1 / PER] >> (QBITS * (c1 % PER))) & MASK) | 0x4B000000u) - 8388608.f;
            h[e] = pack2(fmaf(q0, s, b), fmaf(q1, s, b), T{});
        }
        const int chunk = piece * CPP + j;
        *reinterpret_cast<uint4*>(tile + row * D + ((chunk ^ (row & 7)) * 8)) = make_uint4(h[0], h[1], h[2], h[3]);
    }
}
"""

_LOAD = """    __shared__ __align__(128) T tiles[NW][2][2][16 * D];  // [warp][stage][K, V][row * D + chunk * 8]
    auto load = [&](int stage, int tile) {
        #pragma unroll
        for (int i = 0; i < 16 * CH / 32; ++i) {
            const int c = lane + 32 * i, row = c / CH, chunk = c % CH;
            const int tok = tile + row;
            const bool ok = tok < end;
            const size_t src = ok ? (((size_t)table[tok / BS] * NKV + kvh) * BS + tok % BS) * D + chunk * 8 : 0;
            const int dst = row * D + ((chunk ^ (row & 7)) * 8);
            cp_async16(&tiles[warp][stage][0][dst], k_pages + src, ok);
            cp_async16(&tiles[warp][stage][1][dst], v_pages + src, ok);
        }
        cp_async_commit();
    };
    constexpr int STEP = NW * 16;
    int stage = 0;
    load(0, start + warp * 16);
"""

_QLOAD = """    // A tile's rows as 16-byte pieces of packed words (PPR a row, NP a lane), fetched into registers
    // (zeros past the end: finite values under masked scores), then dequantized into the tile.
    constexpr int WORDS = D * QBITS / 32;
    constexpr int GROUPS = D / QGROUP;
    constexpr int PPR = WORDS / 4;
    constexpr int NP = 16 * PPR / 32;
    constexpr bool PREFETCH = D <= 128;
    __shared__ __align__(128) T tiles[NW][2][16 * D];  // [warp][K, V][row * D + chunk * 8]
    uint4 k_raw[NP], v_raw[NP];
    unsigned k_sb[NP], v_sb[NP];  // a piece's group's scale (low 16 bits) and bias (high)
    auto fetch_piece = [&](int i, int tile, uint4& kr, uint4& vr, unsigned& ks, unsigned& vs) {
        const int c = lane + 32 * i, row = c / PPR, piece = c % PPR;
        const int tok = tile + row;
        if (tok < end) {
            const size_t r = ((size_t)table[tok / BS] * NKV + kvh) * BS + tok % BS;
            kr = __ldg(reinterpret_cast<const uint4*>(k_pages + r * WORDS) + piece);
            vr = __ldg(reinterpret_cast<const uint4*>(v_pages + r * WORDS) + piece);
            const size_t gi = r * GROUPS + piece * (128 / QBITS) / QGROUP;
            ks = pair_bits(k_scales[gi], k_biases[gi]);
            vs = pair_bits(v_scales[gi], v_biases[gi]);
        } else {
            kr = vr = make_uint4(0u, 0u, 0u, 0u);
            ks = vs = 0u;
        }
    };
    auto store_piece_i = [&](int i, uint4 kr, uint4 vr, unsigned ks, unsigned vs) {
        const int c = lane + 32 * i, row = c / PPR, piece = c % PPR;
        store_piece<T, D, QBITS>(tiles[warp][0], row, piece, kr, ks);
        store_piece<T, D, QBITS>(tiles[warp][1], row, piece, vr, vs);
    };
    auto fetch = [&](int tile) {
        #pragma unroll
        for (int i = 0; i < NP; ++i) fetch_piece(i, tile, k_raw[i], v_raw[i], k_sb[i], v_sb[i]);
    };
    // Without PREFETCH a piece is stored as soon as it is loaded, one at a time (not unrolled: the compiler
    // would hoist every piece's loads, holding all their registers next to the accumulators).
    auto store = [&](int tile) {
        if (PREFETCH) {
            #pragma unroll
            for (int i = 0; i < NP; ++i) store_piece_i(i, k_raw[i], v_raw[i], k_sb[i], v_sb[i]);
        } else {
            #pragma unroll 1
            for (int i = 0; i < NP; ++i) {
                uint4 kr, vr;
                unsigned ks, vs;
                fetch_piece(i, tile, kr, vr, ks, vs);
                store_piece_i(i, kr, vr, ks, vs);
            }
        }
    };
    constexpr int STEP = NW * 16;
    if (PREFETCH) fetch(start + warp * 16);
"""

_STAGE = """        load(stage ^ 1, tile + STEP);  // past the end: an all-skipped (zero-filled) group
        cp_async_wait_1();
        __syncwarp();
        const T* kt = tiles[warp][stage][0];
        const T* vt = tiles[warp][stage][1];
"""

_QSTAGE = """        store(tile);
        __syncwarp();
        if (PREFETCH) fetch(tile + STEP);  // in flight during this tile's math
        const T* kt = tiles[warp][0];
        const T* vt = tiles[warp][1];
"""

# (16-bit loop text, quantized loop text, times it occurs)
REPLACEMENTS = [
    ("    constexpr int CH = D / 8;  // 16-byte chunks per row\n", "", 1),
    (_LOAD, _QLOAD, 1),
    (_STAGE, _QSTAGE, 1),
    ("""        __syncwarp();  // every lane is done with this stage before the next load overwrites it
        stage ^= 1;
""", """        __syncwarp();  // every lane is done with the tile before the next store overwrites it
""", 1),
    ("""    asm volatile("cp.async.wait_all;" ::);
""", "", 1),
]


def quantized_accumulate_mma(accumulate_mma: str) -> str:
    """ACCUMULATE_MMA made to read quantized pages; raises if a replacement does not apply."""
    out = accumulate_mma
    for old, new, times in REPLACEMENTS:
        found = out.count(old)
        if found != times:
            raise ValueError(f"the tensor-core decode loop has {found} occurrences of {old.strip()[:40]!r}, not "
                             f"{times}: sources/decode_attention_quant_mma_cuda.py must follow it")
        out = out.replace(old, new)
    return out
