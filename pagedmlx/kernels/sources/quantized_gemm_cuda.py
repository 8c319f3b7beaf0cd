"""CUDA source of the quantized GEMM on tensor cores (sm_80+): y = x @ dequantize(w)^T for x of a step's rows
(M, K) in bfloat16 or float16 and w in MLX's affine layout (mx.quantize: `bits`-bit values packed low bits first
into uint32 words, a scale and a bias per `group_size` values of a row). The weights are dequantized in registers
and never written out, so a step reads them once (a quarter of bf16's bytes at 4 bits) for all its rows, as vLLM's
Marlin does.

A thread block of WN warps takes 16 * WN columns of y (each warp 16: W's rows as mma.sync's A, 16 x 16) for MT
8-row tiles of x (x's rows as B's columns, 16 x 8), over K's 128-wide chunks of its split (KS splits: blocks along
grid z, each writing float32 partial sums that the launch adds). A chunk of x is staged once in shared memory for
the block's warps (read from L2 once per 16 * WN columns, not once per warp); the next chunk's x and weights are
loaded into registers while the warps multiply. In a chunk, lane (g, t) holds the 32 values from 32 t of W's rows
g and g + 8 (one 16-byte load at 4 bits, two at 8) and of x's rows g of each row tile; the mma's k positions are
permuted alike for A and B (mma j takes each lane's values 4 j .. 4 j + 3), which changes only the order of the
float sums. A row's sums never depend on the other rows: the same arithmetic for any M.
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
    // Template: T, OUT (T; float for a split's partial sums), BITS (4 or 8), GS (32, 64 or 128), MT, WN, KS.
    // K % 32 == 0: a lane's 32 values are in K or past it (zeros), and in one group. x's rows past M repeat its
    // last row, W's rows past N its last: never written.
    const int N = w_shape[0], M = x_shape[0], K = x_shape[1];
    const int warp = SIMD_ID, g = LANE >> 2, t = LANE & 3;
    const int n0 = (GROUP_X * WN + warp) * 16, m0 = GROUP_Y * (8 * MT);
    const int chunks = (K + 127) / 128, per_split = (chunks + KS - 1) / KS;
    const int c_begin = GROUP_Z * per_split, c_end = IMIN(c_begin + per_split, chunks);
    const int row_words = K / 32 * BITS, row_groups = K / GS;
    // The x tile: row r's 16-byte piece u of segment s (a lane's 32 values) at r * 20 + 4 s + ((u + s) & 3):
    // 320 bytes a row and the pieces rotated by segment, so that a quarter warp's loads and stores meet no bank twice.
    constexpr int PIECES = 8 * MT * 16, THREADS = 32 * WN, PER_THREAD = (PIECES + THREADS - 1) / THREADS;
    SHARED uint4 xs[8 * MT * 20];
    uint4 xr[PER_THREAD];
    auto load_x = [&](int c) {
        #pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int idx = THREAD_IN_GROUP + i * THREADS, r = idx >> 4, k = c * 128 + (idx & 15) * 8;
            const auto* src = reinterpret_cast<const uint4*>(x + (size_t)IMIN(m0 + r, M - 1) * K + k);
            xr[i] = idx < PIECES && k < K ? LOAD16(src) : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    auto store_x = [&]() {
        #pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int idx = THREAD_IN_GROUP + i * THREADS, r = idx >> 4, s = (idx >> 2) & 3, u = idx & 3;
            if (idx < PIECES) xs[r * 20 + 4 * s + ((u + s) & 3)] = xr[i];
        }
    };
    // A chunk's packed words, scales and biases of rows g and g + 8, held raw until the chunk is multiplied.
    uint4 q[2][BITS / 4];
    float sc[2], bi[2];
    auto load_w = [&](int c) {
        const int kl = c * 128 + 32 * t;
        const bool live = kl < K;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const size_t n = IMIN(n0 + g + 8 * h, N - 1);
            sc[h] = live ? static_cast<float>(scales[n * row_groups + kl / GS]) : 0.0f;
            bi[h] = live ? static_cast<float>(biases[n * row_groups + kl / GS]) : 0.0f;
            const auto* words = reinterpret_cast<const uint4*>(w + n * row_words + kl / 32 * BITS);
            #pragma unroll
            for (int v = 0; v < BITS / 4; ++v) q[h][v] = live ? LOAD16(words + v) : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    float d[MT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) d[mt][e] = 0.0f;
    if (c_begin < c_end) {
        load_x(c_begin);
        load_w(c_begin);
    }
    for (int c = c_begin; c < c_end; ++c) {
        BARRIER();  // every warp is done with the previous chunk's tile
        store_x();
        BARRIER();
        unsigned a[2][16];  // [row g, g + 8][pair]
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            #pragma unroll
            for (int v = 0; v < BITS / 4; ++v) {
                dequantize_word<BITS, T>(q[h][v].x, sc[h], bi[h], &a[h][(4 * v + 0) * 16 / BITS]);
                dequantize_word<BITS, T>(q[h][v].y, sc[h], bi[h], &a[h][(4 * v + 1) * 16 / BITS]);
                dequantize_word<BITS, T>(q[h][v].z, sc[h], bi[h], &a[h][(4 * v + 2) * 16 / BITS]);
                dequantize_word<BITS, T>(q[h][v].w, sc[h], bi[h], &a[h][(4 * v + 3) * 16 / BITS]);
            }
        }
        if (c + 1 < c_end) {
            load_x(c + 1);
            load_w(c + 1);
        }
        if (n0 >= N) continue;  // a warp past N's last tile only stages x
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if (m0 + mt * 8 >= M) break;  // the same for every lane: no mma left half-issued
            const int base = (mt * 8 + g) * 20 + 4 * t;
            #pragma unroll
            for (int j2 = 0; j2 < 4; ++j2) {  // piece j2 holds the pairs of mma 2 j2 and 2 j2 + 1
                const uint4 u = xs[base + ((j2 + t) & 3)];
                const unsigned f0[4] = {a[0][4 * j2], a[1][4 * j2], a[0][4 * j2 + 1], a[1][4 * j2 + 1]};
                const unsigned f1[4] = {a[0][4 * j2 + 2], a[1][4 * j2 + 2], a[0][4 * j2 + 3], a[1][4 * j2 + 3]};
                mma16816_rows(d[mt], f0, u.x, u.y, T());
                mma16816_rows(d[mt], f1, u.z, u.w, T());
            }
        }
    }
    if (n0 >= N) return;
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int m = m0 + mt * 8 + 2 * t + (e & 1), n = n0 + g + 8 * (e >> 1);
            if (m < M && n < N) y[((size_t)GROUP_Z * M + m) * N + n] = static_cast<OUT>(d[mt][e]);
        }
    }
"""  # noqa: E501 - kernel source text, kept verbatim
