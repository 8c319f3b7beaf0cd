"""CUDA source of the paged-decode loop on tensor cores over quantized pages (kv_cache_dtype int8 / int4,
sm_80+): decode_attention_mma_cuda.ACCUMULATE_MMA with its K/V tile loads replaced. Same tiling, online
softmax and per-warp partials; a tile's rows are read from the packed uint32 pages and their groups'
scales and biases, dequantized (q * scale + bias in the model's dtype, as mx.dequantize's output is; int4,
and int8 in fp16, two channels an instruction from magic-number bit patterns) and stored into the same
swizzled shared-memory tile that ldmatrix reads. Plain loads, not cp.async: for
D <= 128 the next tile's packed words are loaded into registers before this tile's math (a
register-staged pipeline, one shared-memory stage); D = 256 loads each tile where it is used (its
accumulators leave no registers for a second tile), as does any D where the launch's QPREFETCH is 0
(PAGEDMLX_QUANT_PREFETCH=0: bf16 int8/128 at D 128 then takes 164 registers instead of 198, three
128-thread groups an SM instead of two; ptxas, sm_90).

A lane loads 16-byte pieces of a row's packed words (16 int8 or 32 int4 channels, inside one group:
groups are >= 32 channels) and the piece's group's scale and bias. quantized_accumulate_mma makes the
loop by exact text replacement, each of which must apply (as sources/decode_attention_quant.py does).

int8 pages with one group a row (AFTER: the default group 128 at head_dim 128; the launch's SCALE_AFTER,
which PAGEDMLX_QUANT_AFTER=0 turns off) are not dequantized. Their tiles hold each byte x as the fp16
1024 + x (one byte permute per two channels), both products run in fp16, and a token's scale s and bias b
apply after them:
- keys: q . k = s (q . (1024 + x)) + (b - 1024 s) sum(q), the query scaled by a power of two into fp16's
  range;
- values: sum_t p_t v_t = S sum_t (p_t s_t / S) (1024 + x_t) + sum_t p_t (b_t - 1024 s_t), the weights
  p_t s_t / S in fp16 and S the largest power of two under any |s_t| so far (rescaled as the softmax's
  maximum is).
In bf16 that skips the fp32 detour int8 values need (no bf16 magic holds 0..255). The keys' products are
exact where dequantizing rounds each key to bf16, and the weights keep fp16's 11 bits where bf16's P has 8.
"""

from pagedmlx.kernels.sources import replace_exactly

QUANT_MMA_HEADER = r"""
// A scale and a bias (16-bit floats) in one register: scale in the low half.
template <typename T>
__device__ inline unsigned pair_bits(T scale, T bias) {
    unsigned short s, b;
    memcpy(&s, &scale, 2);
    memcpy(&b, &bias, 2);
    return unsigned(s) | (unsigned(b) << 16);
}
// Two adjacent channels (c, c + 1) dequantized into one register of T pairs (c in the low half).
// 4-bit and (fp16) 8-bit values become T pairs by bit pattern: a magic constant M (128 in bf16, 1024 in
// fp16) with the value in its low mantissa bits is exactly M + q, and (M + q) - M = q; then q * s + b in
// T pairs, one rounding (the fp32 fma and its rounding to T, which bf16 8-bit keeps, may differ in the
// last bit). A pair of bytes spread into the two halves by one byte permute.
__device__ inline unsigned t2_fma_q(unsigned mq, unsigned s2, unsigned b2, __nv_bfloat16) {
    const __nv_bfloat162 m = __halves2bfloat162(__float2bfloat16(128.f), __float2bfloat16(128.f));
    __nv_bfloat162 x = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&mq), m);
    x = __hfma2(x, *reinterpret_cast<__nv_bfloat162*>(&s2), *reinterpret_cast<__nv_bfloat162*>(&b2));
    return *reinterpret_cast<unsigned*>(&x);
}
__device__ inline unsigned t2_fma_q(unsigned mq, unsigned s2, unsigned b2, __half) {
    const __half2 m = __halves2half2(__float2half(1024.f), __float2half(1024.f));
    __half2 x = __hsub2(*reinterpret_cast<__half2*>(&mq), m);
    x = __hfma2(x, *reinterpret_cast<__half2*>(&s2), *reinterpret_cast<__half2*>(&b2));
    return *reinterpret_cast<unsigned*>(&x);
}
__device__ inline unsigned magic2(__nv_bfloat16) { return 0x43004300u; }
// A register of two 16-bit floats as floats (low half first).
__device__ inline float2 unpack2(unsigned w, __nv_bfloat16) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
}
__device__ inline float2 unpack2(unsigned w, __half) {
    const unsigned short lo = w & 0xFFFF, hi = w >> 16;
    __half a, b;
    memcpy(&a, &lo, 2);
    memcpy(&b, &hi, 2);
    return make_float2(__half2float(a), __half2float(b));
}
template <bool C, class X, class Y> struct pick { using type = X; };
template <class X, class Y> struct pick<false, X, Y> { using type = Y; };
// A scale and a bias (T's bits, scale low) as (s, b - m s) in float: the bias with a magic m's share folded in.
template <typename T>
__device__ inline float2 folded(unsigned scale_bias, float m) {
    const float2 sb = unpack2(scale_bias, T{});
    return make_float2(sb.x, fmaf(-m, sb.x, sb.y));
}
__device__ inline unsigned magic2(__half) { return 0x64006400u; }

// 4-bit: channels c, c + 1 are byte c / 2 of word w (low nibble, high nibble); hi = w >> 4 holds the high
// nibble in the same byte's low bits.
template <typename T>
__device__ inline unsigned pair_int4(unsigned w, unsigned hi, int byte, unsigned s2, unsigned b2) {
    const unsigned spread = __byte_perm(w, hi, byte | ((4 + byte) << 8));
    return t2_fma_q((spread & 0x000F000Fu) | magic2(T{}), s2, b2, T{});
}
// Bytes c, c + 1 of w under 0x64 high bytes: the fp16 pair (1024 + x_c, 1024 + x_c+1), exactly.
__device__ inline unsigned raw_int8_pair(unsigned w, int byte) {
    return __byte_perm(w, 0x64646464u, byte | (4 << 4) | ((byte + 1) << 8) | (4 << 12));
}
// 8-bit in fp16: the raw pair less the magic, then q * s + b.
__device__ inline unsigned pair_int8(unsigned w, int byte, unsigned s2, unsigned b2, float2, __half) {
    return t2_fma_q(raw_int8_pair(w, byte), s2, b2, __half{});
}
// 8-bit in bf16 (8 significant bits hold 0..255 but no magic does): each byte goes through fp32, placed by
// one byte permute in mantissa bits 8-15 under 2^15's exponent, so the float is exactly 2^15 + q; one fma
// with sb = (s, b - 2^15 s) (folded, once a piece) gives q * s + b, and both are rounded to bf16
// together. The folded bias's own rounding is at most s / 512, far under the int8 step s: one instruction
// a channel fewer than subtracting the magic first.
__device__ inline unsigned pair_int8(unsigned w, int byte, unsigned, unsigned, float2 sb, __nv_bfloat16) {
    const float m0 = __uint_as_float(__byte_perm(w, 0x47000000u, 0x7504 | (byte << 4)));
    const float m1 = __uint_as_float(__byte_perm(w, 0x47000000u, 0x7504 | ((byte + 1) << 4)));
    return pack2(fmaf(m0, sb.x, sb.y), fmaf(m1, sb.x, sb.y), __nv_bfloat16{});
}

// One 16-byte piece of a quantized row (channels 128 / QBITS * piece on) dequantized into the
// swizzled tile: chunk c (8 channels) of row r at r * D + ((c ^ (r & 7)) * 8), as load() stores it.
// RAW (int8 only): the bytes as fp16 1024 + x, not dequantized (AFTER's pages).
template <typename T, int D, int QBITS, bool RAW = false>
__device__ inline void store_piece(T* tile, int row, int piece, uint4 raw, unsigned scale_bias) {
    constexpr int PER = 32 / QBITS;
    constexpr int CPP = 128 / QBITS / 8;  // 8-channel chunks per piece: 2 (int8), 4 (int4)
    const unsigned s2 = __byte_perm(scale_bias, 0u, 0x1010), b2 = __byte_perm(scale_bias, 0u, 0x3232);
    const float2 sb32 = folded<T>(scale_bias, 32768.f);  // bf16 int8's only (unused, so dropped, elsewhere)
    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
    #pragma unroll
    for (int j = 0; j < CPP; ++j) {
        unsigned h[4];
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int c = 8 * j + 2 * e;
            const unsigned word = w[c / PER];
            h[e] = QBITS == 4 ? pair_int4<T>(word, word >> 4, (c % PER) / 2, s2, b2)
                 : RAW ? raw_int8_pair(word, c % PER) : pair_int8(word, c % PER, s2, b2, sb32, T{});
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
    constexpr bool PREFETCH = D <= 128 && QPREFETCH;
    __shared__ __align__(128) T tiles[NW][2][16 * D];  // [warp][K, V][row * D + chunk * 8]
    __shared__ float2 terms[NW][2][16];  // AFTER: [warp][K, V][tile row]: the row's (s, b - 1024 s)
    uint4 k_raw[NP], v_raw[NP];
    unsigned k_sb[NP], v_sb[NP];  // a piece's group's scale (low 16 bits) and bias (high); not AFTER's
    unsigned row_sb = 0u;  // AFTER's instead: lane l's is row l % 16's, of the keys (l < 16) or the values
    auto fetch_terms = [&](int tile) {
        const int tok = tile + (lane & 15);
        row_sb = 0u;
        if (AFTER && tok < end) {
            const size_t r = ((size_t)table[tok / BS] * NKV + kvh) * BS + tok % BS;
            row_sb = lane < 16 ? pair_bits(k_scales[r], k_biases[r]) : pair_bits(v_scales[r], v_biases[r]);
        }
    };
    auto fetch_piece = [&](int i, int tile, uint4& kr, uint4& vr, unsigned& ks, unsigned& vs) {
        const int c = lane + 32 * i, row = c / PPR, piece = c % PPR;
        const int tok = tile + row;
        if (tok < end) {
            const size_t r = ((size_t)table[tok / BS] * NKV + kvh) * BS + tok % BS;
            kr = __ldg(reinterpret_cast<const uint4*>(k_pages + r * WORDS) + piece);
            vr = __ldg(reinterpret_cast<const uint4*>(v_pages + r * WORDS) + piece);
            const size_t gi = r * GROUPS + piece * (128 / QBITS) / QGROUP;
            ks = vs = 0u;
            if (!AFTER) {
                ks = pair_bits(k_scales[gi], k_biases[gi]);
                vs = pair_bits(v_scales[gi], v_biases[gi]);
            }
        } else {
            kr = vr = make_uint4(0u, 0u, 0u, 0u);
            ks = vs = 0u;
        }
    };
    auto store_piece_i = [&](int i, uint4 kr, uint4 vr, unsigned ks, unsigned vs) {
        const int c = lane + 32 * i, row = c / PPR, piece = c % PPR;
        store_piece<T, D, QBITS, AFTER>(tiles[warp][0], row, piece, kr, ks);
        store_piece<T, D, QBITS, AFTER>(tiles[warp][1], row, piece, vr, vs);
    };
    auto fetch = [&](int tile) {
        fetch_terms(tile);
        #pragma unroll
        for (int i = 0; i < NP; ++i) fetch_piece(i, tile, k_raw[i], v_raw[i], k_sb[i], v_sb[i]);
    };
    // Without PREFETCH a piece is stored as soon as it is loaded, one at a time (not unrolled: the compiler
    // would hoist every piece's loads, holding all their registers next to the accumulators).
    auto store = [&](int tile) {
        if (!PREFETCH) fetch_terms(tile);
        if (AFTER) terms[warp][lane >> 4][lane & 15] = folded<T>(row_sb, 1024.f);
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

_AFTER_SETUP = """    // AFTER (the module's docstring): the query in fp16, scaled by a power of two that puts its row's
    // largest |q| in [2^14, 2^15) (exact for a 16-bit query), and the row's two terms of each score with the
    // softmax scale folded in: sc / 2^e (times a token's s) and sc sum(q) (times its b - 1024 s). The values'
    // running S (v_top, from the smallest normal float) and sum_t p_t (b_t - 1024 s_t) (v_bias, this lane's tokens).
    constexpr bool AFTER = SCALE_AFTER && QBITS == 8 && QGROUP == D;
    using MT = typename pick<AFTER, __half, T>::type;  // the products' inputs
    float q_unscale = sc, q_sum = 0.f, v_top = __uint_as_float(0x00800000u), v_bias = 0.f;
    if (AFTER) {
        float big = 0.f;
        #pragma unroll
        for (int k = 0; k < KS; ++k) {
            #pragma unroll
            for (int i = 0; i < 2; ++i) {
                const float2 f = unpack2(qa[k][i], T{});
                big = fmaxf(big, fmaxf(fabsf(f.x), fabsf(f.y)));
                q_sum += f.x + f.y;
            }
        }
        big = fmaxf(big, __shfl_xor_sync(0xffffffff, big, 1));
        big = fmaxf(big, __shfl_xor_sync(0xffffffff, big, 2));
        q_sum += __shfl_xor_sync(0xffffffff, q_sum, 1);
        q_sum += __shfl_xor_sync(0xffffffff, q_sum, 2);
        int e;
        frexpf(big, &e);  // big = f 2^e, f in [0.5, 1) (e = 0 for a zero row)
        e = max(e, -100);
        const float up = ldexpf(1.f, 15 - e);
        #pragma unroll
        for (int k = 0; k < KS; ++k) {
            #pragma unroll
            for (int i = 0; i < 2; ++i) {
                const float2 f = unpack2(qa[k][i], T{});
                qa[k][i] = pack2(f.x * up, f.y * up, __half{});
            }
        }
        q_unscale = sc * ldexpf(1.f, e - 15);
        q_sum *= sc;
    }
    float acc[NT][4];
"""

_SCORE = """                s[j][e] = tile + 8 * j + 2 * t + e < end ? s[j][e] * sc : NEG_INF;
"""
_QSCORE = """                const int r = 8 * j + 2 * t + e;
                const float sv = AFTER ? fmaf(terms[warp][0][r].x * q_unscale, s[j][e], terms[warp][0][r].y * q_sum)
                                         : s[j][e] * sc;
                s[j][e] = tile + r < end ? sv : NEG_INF;
"""

_WEIGHTS = """        unsigned pa0, pa2;
        float corr_v = corr;  // the values' accumulators' factor: the softmax's, and S's growth under AFTER
        if (AFTER) {
            float2 vt[2][2];
            float big = 0.f;
            v_bias *= corr;
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    vt[j][e] = terms[warp][1][8 * j + 2 * t + e];
                    big = fmaxf(big, fabsf(vt[j][e].x));
                    v_bias = fmaf(p[j][e], vt[j][e].y, v_bias);
                }
            }
            big = fmaxf(big, __shfl_xor_sync(0xffffffff, big, 1));
            big = fmaxf(big, __shfl_xor_sync(0xffffffff, big, 2));
            const float top = fmaxf(v_top, __uint_as_float(__float_as_uint(big) & 0x7F800000u));
            corr_v = corr * (v_top / top);  // powers of two: exact
            v_top = top;
            const float inv = 1.f / top;
            pa0 = pack2(p[0][0] * vt[0][0].x * inv, p[0][1] * vt[0][1].x * inv, __half{});
            pa2 = pack2(p[1][0] * vt[1][0].x * inv, p[1][1] * vt[1][1].x * inv, __half{});
        } else {
            pa0 = pack2(p[0][0], p[0][1], T{});
            pa2 = pack2(p[1][0], p[1][1], T{});
        }
"""

_AFTER_VALUES = """    if (AFTER) {  // the values' sums back to their scale: S acc + the row's sum_t p_t (b_t - 1024 s_t)
        v_bias += __shfl_xor_sync(0xffffffff, v_bias, 1);
        v_bias += __shfl_xor_sync(0xffffffff, v_bias, 2);
        #pragma unroll
        for (int n = 0; n < NT; ++n) {
            acc[n][0] = fmaf(acc[n][0], v_top, v_bias);
            acc[n][1] = fmaf(acc[n][1], v_top, v_bias);
        }
    }
"""  # noqa: E501 - kernel source text, kept verbatim

# (16-bit loop text, quantized loop text, times it occurs)
REPLACEMENTS = [
    ("    float acc[NT][4];\n", _AFTER_SETUP, 1),
    ("""                mma16816(s[j], qa[2 * p][0], qa[2 * p][1], kb[0], kb[1], T{});
                mma16816(s[j], qa[2 * p + 1][0], qa[2 * p + 1][1], kb[2], kb[3], T{});
""", """                mma16816(s[j], qa[2 * p][0], qa[2 * p][1], kb[0], kb[1], MT{});
                mma16816(s[j], qa[2 * p + 1][0], qa[2 * p + 1][1], kb[2], kb[3], MT{});
""", 1),
    (_SCORE, _QSCORE, 1),
    ("""        const unsigned pa0 = pack2(p[0][0], p[0][1], T{}), pa2 = pack2(p[1][0], p[1][1], T{});
""", _WEIGHTS, 1),
    ("""            acc[n][0] *= corr; acc[n][1] *= corr;
            acc[n + 1][0] *= corr; acc[n + 1][1] *= corr;
            mma16816(acc[n], pa0, pa2, vb[0], vb[1], T{});
            mma16816(acc[n + 1], pa0, pa2, vb[2], vb[3], T{});
""", """            acc[n][0] *= corr_v; acc[n][1] *= corr_v;
            acc[n + 1][0] *= corr_v; acc[n + 1][1] *= corr_v;
            mma16816(acc[n], pa0, pa2, vb[0], vb[1], MT{});
            mma16816(acc[n + 1], pa0, pa2, vb[2], vb[3], MT{});
""", 1),
    ("    l += __shfl_xor_sync(0xffffffff, l, 1);\n",
     _AFTER_VALUES + "    l += __shfl_xor_sync(0xffffffff, l, 1);\n", 1),
    ("mma16816(", "mma16816_top(", 4),
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
    return replace_exactly(accumulate_mma, REPLACEMENTS, "tensor-core decode loop",
                           "sources/decode_attention_quant_mma_cuda.py")
