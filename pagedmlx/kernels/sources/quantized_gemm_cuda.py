"""CUDA source of the quantized GEMM on tensor cores (sm_80+): y = x @ dequantize(w)^T for x of a step's rows
(M, K) in bfloat16 or float16 and w in MLX's affine layout (mx.quantize: `bits`-bit values packed low bits first
into uint32 words, a scale and a bias per `group_size` values of a row). The weights are dequantized in registers
and never written out, so a step reads them once (a quarter of bf16's bytes at 4 bits) for all its rows, as vLLM's
Marlin does.

A thread block computes NT 16-column tiles of y (columns of W as mma.sync's A, 16 x 16) for MT 8-row tiles of x (x's
rows as B's columns, 16 x 8); its WARPS warps take K's 128-wide chunks in turn and add their partial tiles in
shared memory at the end. In a chunk, lane (g, t) holds the 32 values from 32 t of W's rows g and g + 8 of each tile
(one 16-byte load at 4 bits, two at 8) and of x's rows g of each row tile (four 16-byte loads); the mma's k
positions are permuted alike for A and B (mma j takes each lane's values 4 j .. 4 j + 3), which changes only the
order of the float sums. A row's sums never depend on the other rows: the same arithmetic for any M.
"""

QUANTIZED_GEMM_HEADER = r"""
// Pairs of dequantized values of one packed word (values low bits first), as the 16-bit pairs an mma register
// holds: out[i] = (s * q[2i] + b, s * q[2i + 1] + b), each rounded once to T. 2^23 + q read as a float is exact.
template <int BITS, class T>
__device__ inline void dequantize_word(unsigned q, float s, float b, unsigned* out) {
    constexpr unsigned MASK = (1u << BITS) - 1u;
    #pragma unroll
    for (int i = 0; i < 16 / BITS; ++i) {
        const float lo = __uint_as_float(0x4B000000u | ((q >> (2 * i * BITS)) & MASK)) - 8388608.0f;
        const float hi = __uint_as_float(0x4B000000u | ((q >> ((2 * i + 1) * BITS)) & MASK)) - 8388608.0f;
        out[i] = pack2(fmaf(s, lo, b), fmaf(s, hi, b), T());
    }
}
"""

QUANTIZED_GEMM = """
    // Template: T, BITS (4 or 8), GS (32, 64 or 128), NT, MT, WARPS. K % 32 == 0: a lane's 32 values are in K or
    // past it (zeros), and in one group. x's rows past M repeat its last row, W's rows past N its last: never written.
    const int N = w_shape[0], M = x_shape[0], K = x_shape[1];
    const int warp = SIMD_ID, g = LANE >> 2, t = LANE & 3;
    const int n0 = GROUP_X * (16 * NT), m0 = GROUP_Y * (8 * MT);
    const int row_words = K / 32 * BITS, row_groups = K / GS;
    float d[NT][MT][4];
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt)
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int e = 0; e < 4; ++e) d[nt][mt][e] = 0.0f;
    // A chunk's packed words, scales and biases are loaded one chunk ahead (held raw), so that a warp's next
    // weights are in flight while it multiplies.
    uint4 q[NT][2][BITS / 4];
    float sc[NT][2], bi[NT][2];
    auto load = [&](int k0) {
        const int kl = k0 + 32 * t;
        const bool live = kl < K;
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const size_t n = IMIN(n0 + nt * 16 + g + 8 * h, N - 1);
                sc[nt][h] = live ? static_cast<float>(scales[n * row_groups + kl / GS]) : 0.0f;
                bi[nt][h] = live ? static_cast<float>(biases[n * row_groups + kl / GS]) : 0.0f;
                const auto* words = reinterpret_cast<const uint4*>(w + n * row_words + kl / 32 * BITS);
                #pragma unroll
                for (int v = 0; v < BITS / 4; ++v) q[nt][h][v] = live ? LOAD16(words + v) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };
    load(warp * 128);
    for (int k0 = warp * 128; k0 < K; k0 += WARPS * 128) {
        const int kl = k0 + 32 * t;
        const bool live = kl < K;
        unsigned a[NT][2][16];  // [tile][row g, g + 8][pair]
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                #pragma unroll
                for (int v = 0; v < BITS / 4; ++v) {
                    const uint4 u = q[nt][h][v];
                    dequantize_word<BITS, T>(u.x, sc[nt][h], bi[nt][h], &a[nt][h][(4 * v + 0) * 16 / BITS]);
                    dequantize_word<BITS, T>(u.y, sc[nt][h], bi[nt][h], &a[nt][h][(4 * v + 1) * 16 / BITS]);
                    dequantize_word<BITS, T>(u.z, sc[nt][h], bi[nt][h], &a[nt][h][(4 * v + 2) * 16 / BITS]);
                    dequantize_word<BITS, T>(u.w, sc[nt][h], bi[nt][h], &a[nt][h][(4 * v + 3) * 16 / BITS]);
                }
            }
        }
        if (k0 + WARPS * 128 < K) load(k0 + WARPS * 128);
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if (m0 + mt * 8 >= M) break;  // the same for every lane: no mma left half-issued
            const auto* xq = reinterpret_cast<const uint4*>(x + (size_t)IMIN(m0 + mt * 8 + g, M - 1) * K + kl);
            unsigned xv[16];
            #pragma unroll
            for (int v = 0; v < 4; ++v) {
                const uint4 u = live ? LOAD16(xq + v) : make_uint4(0u, 0u, 0u, 0u);
                xv[4 * v] = u.x;
                xv[4 * v + 1] = u.y;
                xv[4 * v + 2] = u.z;
                xv[4 * v + 3] = u.w;
            }
            #pragma unroll
            for (int j = 0; j < 8; ++j) {
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const unsigned f[4] = {a[nt][0][2 * j], a[nt][1][2 * j], a[nt][0][2 * j + 1], a[nt][1][2 * j + 1]};
                    mma16816_rows(d[nt][mt], f, xv[2 * j], xv[2 * j + 1], T());
                }
            }
        }
    }
    SHARED float part[WARPS][NT * 16][MT * 8 + 1];  // [warp][column in the block][row]; +1: no bank conflicts
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            part[warp][nt * 16 + g][mt * 8 + 2 * t] = d[nt][mt][0];
            part[warp][nt * 16 + g][mt * 8 + 2 * t + 1] = d[nt][mt][1];
            part[warp][nt * 16 + g + 8][mt * 8 + 2 * t] = d[nt][mt][2];
            part[warp][nt * 16 + g + 8][mt * 8 + 2 * t + 1] = d[nt][mt][3];
        }
    }
    BARRIER();
    for (int i = THREAD_IN_GROUP; i < NT * 16 * MT * 8; i += 32 * WARPS) {
        const int c = i % (NT * 16), r = i / (NT * 16);
        if (n0 + c < N && m0 + r < M) {
            float s = 0.0f;
            #pragma unroll
            for (int v = 0; v < WARPS; ++v) s += part[v][c][r];
            y[(size_t)(m0 + r) * N + n0 + c] = static_cast<T>(s);
        }
    }
"""  # noqa: E501 - kernel source text, kept verbatim
