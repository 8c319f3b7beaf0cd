"""CUDA source of the quantized GEMM on tensor cores (sm_80+): y = x @ dequantize(w)^T for x of a step's rows (M, K) in
bfloat16 or float16 and w in MLX's affine layout (mx.quantize: `bits`-bit values packed low bits first into uint32
words, a scale and a bias per `group_size` values of a row). The weights are dequantized in registers and never
written out, so a step reads them once (a quarter of bf16's bytes at 4 bits) for all its rows, as vLLM's Marlin
does.

A thread block of WN warps takes 16 * WN columns of y (each warp 16: W's rows as mma.sync's A, 16 x 16) for MT 8-row
tiles of x (x's rows as B's columns, 16 x 8), over K's 128-wide chunks of its split (KS splits: blocks along grid z:
each writes float32 partial sums to a workspace and counts itself done on its tile's counter, zero at launch; the
tile's last block adds the KS partials in split order, writes y and sets the counter back to zero). ST chunks are in
flight at once: a chunk's x is copied by cp.async into one of ST slots of dynamic shared memory (one copy for the
block's warps), its weights, scales and biases are loaded into one of ST register slots, ST - 1 chunks ahead of the
one the warps multiply, so that a chunk's memory latency is paid once per ST chunks. In a chunk, lane (g, t) holds
the 32 values from 32 t of W's rows g and g + 8 (one 16-byte load at 4 bits, two at 8) and of x's rows g of each row
tile.
The mma's k positions are permuted alike for A and B, which changes only the order of the float sums: at 8 bits mma
j takes each lane's values 4 j .. 4 j + 3; at 4 bits a 16-bit pair holds values i and i + 4 of a word (one shift and
one mask give both nibbles in place for a magic-number dequantization in 16-bit pairs), and x's pairs are regrouped
alike (__byte_perm). A row's sums never depend on the other rows: the same arithmetic for any M.
"""

QUANTIZED_GEMM_HEADER = r"""
// x's ST slots in dynamic shared memory (the launch asks for their bytes: past CUDA's 48 KB of static shared memory
// at 8 row tiles and 3+ chunks in flight); the kernel emulator compiles them as a static array.
#if defined(__CUDACC__)
#define X_SLOTS(name, count) extern __shared__ uint4 name[]
#else
#define X_SLOTS(name, count) static uint4 name[count]
#endif
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
// A 16-bit value's bits as a float.
__device__ inline float raw_float(unsigned short r, __nv_bfloat16) { return __uint_as_float(unsigned(r) << 16); }
__device__ inline float raw_float(unsigned short r, __half) { return __half2float(*reinterpret_cast<const __half*>(&r)); }
// A 16-bit pair type and the pair of its magic number M (bf16 128, fp16 1024): M + q for q < 16 is exact in it.
template <class T> struct pair_of;
template <> struct pair_of<__nv_bfloat16> { typedef __nv_bfloat162 type; static constexpr unsigned MAGIC = 0x43004300u; };
template <> struct pair_of<__half> { typedef __half2 type; static constexpr unsigned MAGIC = 0x64006400u; };
// r holds M + q in each half: (s * q_lo + b, s * q_hi + b), each fma rounded once to T (s2, b2: s and b twice).
template <class T>
__device__ inline unsigned scale_pair(unsigned r, unsigned s2, unsigned b2) {
    typedef typename pair_of<T>::type P;
    const unsigned m = pair_of<T>::MAGIC;
    const P v = __hsub2(*reinterpret_cast<const P*>(&r), *reinterpret_cast<const P*>(&m));
    P out = __hfma2(v, *reinterpret_cast<const P*>(&s2), *reinterpret_cast<const P*>(&b2));
    return *reinterpret_cast<unsigned*>(&out);
}
// A 4-bit word's eight values as four pairs (i, i + 4): out[i] = (s q[i] + b, s q[i + 4] + b).
template <class T>
__device__ inline void dequantize_word4(unsigned q, unsigned s2, unsigned b2, unsigned* out) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = scale_pair<T>(((q >> (4 * i)) & 0x000F000Fu) | pair_of<T>::MAGIC, s2, b2);
}
"""  # noqa: E501 - kernel source text, kept verbatim

QUANTIZED_GEMM = """
    // Template: T, BITS (4 or 8), GS (32, 64 or 128), MT, WN, KS, ST. The ROWS prelude (DENSE_ROWS or GROUPED_ROWS)
    // says where a block's rows of x come from and where its rows of y go, and which expert's weights it reads.
    // K % 32 == 0: a lane's 32 values are in K or past it (zeros), and in one group. x's rows past M repeat its
    // last row, W's rows past N its last: never written. counters: one int a tile (row block, column block), zero at
    // launch and again when it ends (an input: a stretch of a ring kept by the host, kernels/quantized_gemm.py).
    const int N = QG_N, M = x_shape[0], K = x_shape[1];
    const int warp = SIMD_ID, g = LANE >> 2, t = LANE & 3;
    // Row blocks along x: the blocks of one column tile run together and read its weights from L2 after the first.
    const int n0 = (GROUP_Y * WN + warp) * 16, m0 = GROUP_X * (8 * MT);
    const int expert = QG_EXPERT;
    if (expert < 0) return;  // a row block past the step's (the same for the whole block: before any barrier)
    const int chunks = (K + 127) / 128, per_split = (chunks + KS - 1) / KS;
    const int c_begin = GROUP_Z * per_split, c_end = IMIN(c_begin + per_split, chunks);
    const int row_words = K / 32 * BITS, row_groups = K / GS;
    const auto* sraw = reinterpret_cast<const unsigned short*>(scales) + (size_t)expert * N * row_groups;
    const auto* braw = reinterpret_cast<const unsigned short*>(biases) + (size_t)expert * N * row_groups;
    const auto* wq = w + (size_t)expert * N * row_words;
    // x's slot: row r's 16-byte piece u of segment s (a lane's 32 values) at r * 20 + 4 s + ((u + s) & 3): 320
    // bytes a row and the pieces rotated by segment, so that a quarter warp's reads meet no bank twice.
    constexpr int PIECES = 8 * MT * 16, THREADS = 32 * WN, PER_THREAD = (PIECES + THREADS - 1) / THREADS;
    constexpr int SLOT = 8 * MT * 20;  // uint4 a slot
    X_SLOTS(xs, ST * SLOT);
    uint4 q[ST][2][BITS / 4];  // a chunk's packed words of rows g and g + 8, its scales and biases, raw
    unsigned short sr[ST][2], br[ST][2];
    // Chunk c into slot `slot` (one cp.async group per chunk, empty past the split: the wait counts stay aligned).
    auto issue = [&](int c, int slot) {
        if (c < c_end) {
            #pragma unroll
            for (int i = 0; i < PER_THREAD; ++i) {
                const int idx = THREAD_IN_GROUP + i * THREADS, r = idx >> 4, s = (idx >> 2) & 3, u = idx & 3;
                const int k = c * 128 + (idx & 15) * 8;
                if (idx < PIECES)
                    cp_async16(&xs[slot * SLOT + r * 20 + 4 * s + ((u + s) & 3)],
                               x + (size_t)QG_X_ROW(r) * K + (k < K ? k : 0), k < K);
            }
            const int kl = c * 128 + 32 * t;
            const bool live = kl < K;
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const size_t n = IMIN(n0 + g + 8 * h, N - 1);
                sr[slot][h] = live ? sraw[n * row_groups + kl / GS] : (unsigned short)0;
                br[slot][h] = live ? braw[n * row_groups + kl / GS] : (unsigned short)0;
                const auto* words = reinterpret_cast<const uint4*>(wq + n * row_words + kl / 32 * BITS);
                #pragma unroll
                for (int v = 0; v < BITS / 4; ++v) q[slot][h][v] = live ? LOAD16(words + v) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
        cp_async_commit();
    };
    // The warp's 16 columns of chunk `slot` for every row tile.
    auto multiply = [&](int slot, float (&d)[MT][4]) {
        unsigned a[2][16];  // [row g, g + 8][pair]
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned s2 = sr[slot][h] * 0x10001u, b2 = br[slot][h] * 0x10001u;
            #pragma unroll
            for (int v = 0; v < BITS / 4; ++v) {
                const unsigned words[4] = {q[slot][h][v].x, q[slot][h][v].y, q[slot][h][v].z, q[slot][h][v].w};
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if constexpr (BITS == 4) dequantize_word4<T>(words[j], s2, b2, &a[h][4 * j]);
                    else dequantize_word<BITS, T>(words[j], raw_float(sr[slot][h], T()), raw_float(br[slot][h], T()),
                                                  &a[h][(4 * v + j) * 2]);
                }
            }
        }
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if (!QG_TILE_LIVE(mt)) break;  // the same for every lane: no mma left half-issued
            const int base = (mt * 8 + g) * 20 + 4 * t;
            #pragma unroll
            for (int j2 = 0; j2 < 4; ++j2) {  // piece j2: x's values 8 j2 .. 8 j2 + 7 of the lane's segment
                const uint4 u = xs[slot * SLOT + base + ((j2 + t) & 3)];
                const unsigned f0[4] = {a[0][4 * j2], a[1][4 * j2], a[0][4 * j2 + 1], a[1][4 * j2 + 1]};
                const unsigned f1[4] = {a[0][4 * j2 + 2], a[1][4 * j2 + 2], a[0][4 * j2 + 3], a[1][4 * j2 + 3]};
                if constexpr (BITS == 4) {  // x's pairs as the weights': (0, 4), (1, 5) | (2, 6), (3, 7)
                    mma16816_rows(d[mt], f0, __byte_perm(u.x, u.z, 0x5410), __byte_perm(u.x, u.z, 0x7632), T());
                    mma16816_rows(d[mt], f1, __byte_perm(u.y, u.w, 0x5410), __byte_perm(u.y, u.w, 0x7632), T());
                } else {
                    mma16816_rows(d[mt], f0, u.x, u.y, T());
                    mma16816_rows(d[mt], f1, u.z, u.w, T());
                }
            }
        }
    };
    float d[MT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int e = 0; e < 4; ++e) d[mt][e] = 0.0f;
    #pragma unroll
    for (int s = 0; s < ST - 1; ++s) issue(c_begin + s, s);
    for (int c0 = c_begin; c0 < c_end; c0 += ST) {
        #pragma unroll
        for (int s = 0; s < ST; ++s) {  // register slots indexed by the unrolled s only
            if (c0 + s >= c_end) break;
            cp_async_wait<ST - 2>();  // this thread's copies of chunk c0 + s have landed
            BARRIER();  // everyone's have; every warp is done with the slot chunk c0 + s + ST - 1 takes
            issue(c0 + s + ST - 1, (s + ST - 1) % ST);
            if (n0 < N) multiply(s, d);  // a warp past N's last tile only stages x
        }
    }
    // Unsplit: y. Split: this split's partials, then the tile's last block adds them all (in split order, so the
    // sums are the same whichever block comes last). Each launch has counters of its own: MLX may run independent
    // kernels at once (CUDA graph branches), so none may be shared by launches in flight together.
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int m = QG_OUT_ROW(m0 + mt * 8 + 2 * t + (e & 1)), n = n0 + g + 8 * (e >> 1);
            if (m >= 0 && n < N) {
                if constexpr (KS == 1) y[(size_t)m * N + n] = static_cast<T>(d[mt][e]);
                else partials[((size_t)GROUP_Z * M + m) * N + n] = d[mt][e];
            }
        }
    }
    if constexpr (KS > 1) {
        SHARED int last;
        int* count = const_cast<int*>(counters) + GROUP_Y * ((M + 8 * MT - 1) / (8 * MT)) + GROUP_X;
        __threadfence();  // this block's partials before its count
        BARRIER();
        if (THREAD_IN_GROUP == 0) last = atomicAdd(count, 1) == KS - 1;
        BARRIER();
        if (!last) return;
        if (THREAD_IN_GROUP == 0) *count = 0;  // every block of the tile has counted: zero for the ring's next lap
        __threadfence();
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = QG_OUT_ROW(m0 + mt * 8 + 2 * t + (e & 1)), n = n0 + g + 8 * (e >> 1);
                if (m >= 0 && n < N) {
                    float sum = 0.0f;
                    for (int z = 0; z < KS; ++z) sum += __ldcg(partials + ((size_t)z * M + m) * N + n);
                    y[(size_t)m * N + n] = static_cast<T>(sum);
                }
            }
        }
    }
"""  # noqa: E501 - kernel source text, kept verbatim

# A product over a step's rows: x (M, K) @ W (N, K)^T; rows past M repeat x's last and are not written.
DENSE_ROWS = """
#define QG_N w_shape[0]
#define QG_EXPERT 0
#define QG_X_ROW(r) IMIN(m0 + (r), M - 1)
#define QG_TILE_LIVE(mt) (m0 + (mt) * 8 < M)
#define QG_OUT_ROW(m) ((m) < M ? (m) : -1)
"""

# The experts' products of a MoE layer in one launch (vLLM's fused MoE): W (E, N, K) holds every expert's weights;
# ids (row blocks x 8 MT) lists each block's (token, expert) pairs, all of one expert, experts[GROUP_X] (-1: a block
# past the step's); slot s reads x's row x_rows[s] (its token's, or the pair's own for the last product) and writes
# y's row ids[s]. A block's pairs come first, -1 after them (kernels/fused_moe.py's moe_align).
GROUPED_ROWS = """
#define QG_N w_shape[1]
#define QG_EXPERT experts[GROUP_X]
#define QG_X_ROW(r) x_rows[m0 + (r)]
#define QG_TILE_LIVE(mt) (ids[m0 + (mt) * 8] >= 0)
#define QG_OUT_ROW(m) ids[m]
"""

# After the body: a translation unit of several kernels (nvcc's compile test) defines the prelude's names again.
END_ROWS = """
#undef QG_N
#undef QG_EXPERT
#undef QG_X_ROW
#undef QG_TILE_LIVE
#undef QG_OUT_ROW
"""
