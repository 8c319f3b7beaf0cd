"""The tensor-core kernels' PTX helpers (kernels/sources/decode_attention_mma_cuda.MMA_HEADER) for the emulator:
the same functions, in C++ on emu.h's fibers, so that the tensor-core decode kernels run on the CPU.

ldmatrix (.x4, .trans) and mma.sync m16n8k16 follow PTX's fragment layouts (the ones
tests/test_mma_fragments.py writes out): a lane's registers come from the rows other lanes address,
exchanged through the SIMD group as shuffles are. cp.async is a plain 16-byte copy (zero-filled when
skipped), so the pipeline's waits are no-ops: what this cannot show is a missing wait on the GPU. The 16-bit
tensor-core kernel, run through the same helpers, is what shows the emulation right (tests use it so).
"""

EMU_MMA_HEADER = r"""
#define __align__(n) __attribute__((aligned(n)))
inline void __syncwarp() { emu::park(emu::WAIT_SIMD); }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
namespace emu_mma {
// Every lane's value, read by every lane of the SIMD group (all lanes must call).
inline void all_lanes(uint64_t v, uint64_t (&out)[32]) {
    emu::Ctx& c = emu::C();
    c.xchg[c.cur] = v;
    emu::park(emu::WAIT_SIMD);
    for (int i = 0; i < 32; ++i) out[i] = c.xchg[emu::simd() * 32 + i];
    emu::park(emu::WAIT_SIMD);
}
inline float half_bits(unsigned bits, __nv_bfloat16) { __nv_bfloat16 h; h.bits = uint16_t(bits); return float(h); }
inline float half_bits(unsigned bits, __half) { uint16_t b = uint16_t(bits); __half h; std::memcpy(&h, &b, 2); return float(h); }
}  // namespace emu_mma

// The 16-bit pair intrinsics the quantized tile loads use; a pair's fma rounds its float fma to T.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t bytes = uint64_t(x) | (uint64_t(y) << 32);
    unsigned out = 0;
    for (int i = 0; i < 4; ++i) out |= unsigned((bytes >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return out;
}
template <class T> struct pair16 { T x, y; };
typedef pair16<__nv_bfloat16> __nv_bfloat162;
typedef pair16<__half> __half2;
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __half __float2half(float f) { return __half(f); }
inline float __half2float(__half h) { return float(h); }
inline float __bfloat162float(__nv_bfloat16 h) { return float(h); }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return {a, b}; }
inline __half2 __halves2half2(__half a, __half b) { return {a, b}; }
template <class T> pair16<T> __hsub2(pair16<T> a, pair16<T> b) {
    return {T(float(a.x) - float(b.x)), T(float(a.y) - float(b.y))};
}
template <class T> pair16<T> __hfma2(pair16<T> a, pair16<T> b, pair16<T> c) {
    return {T(std::fma(float(a.x), float(b.x), float(c.x))), T(std::fma(float(a.y), float(b.y), float(c.y)))};
}

inline unsigned pack2(float a, float b, __nv_bfloat16) {
    return unsigned(__nv_bfloat16(a).bits) | (unsigned(__nv_bfloat16(b).bits) << 16);
}
inline unsigned pack2(float a, float b, __half) {
    __half x = __half(a), y = __half(b);
    uint16_t u, v;
    std::memcpy(&u, &x, 2);
    std::memcpy(&v, &y, 2);
    return unsigned(u) | (unsigned(v) << 16);
}
// d += A (16 x 16, rows 8..15 zero) * B (16 x 8): a0 = A[g][2t..2t+1], a2 = A[g][2t+8..2t+9];
// b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][...] (zero rows).
template <class T>
inline void mma16816(float (&d)[4], unsigned a0, unsigned a2, unsigned b0, unsigned b1, T tag) {
    uint64_t a[32], b[32];
    emu_mma::all_lanes(uint64_t(a0) | (uint64_t(a2) << 32), a);
    emu_mma::all_lanes(uint64_t(b0) | (uint64_t(b1) << 32), b);
    const int g = emu::lane() >> 2, t = emu::lane() & 3;
    auto A = [&](int row, int k) {  // lane 4 row + (k % 8) / 2 holds A[row][k]
        const uint64_t v = a[4 * row + (k % 8) / 2];
        const unsigned w = unsigned(k >= 8 ? v >> 32 : v);
        return emu_mma::half_bits(k % 2 ? w >> 16 : w & 0xFFFF, tag);
    };
    auto B = [&](int k, int col) {  // lane 4 col + (k % 8) / 2 holds B[k][col]
        const uint64_t v = b[4 * col + (k % 8) / 2];
        const unsigned w = unsigned(k >= 8 ? v >> 32 : v);
        return emu_mma::half_bits(k % 2 ? w >> 16 : w & 0xFFFF, tag);
    };
    for (int e = 0; e < 2; ++e) {
        float s = 0.f;
        for (int k = 0; k < 16; ++k) s += A(g, k) * B(k, 2 * t + e);
        d[e] += s;
    }
}
template <class T>
inline void mma16816_top(float (&d)[4], unsigned a0, unsigned a2, unsigned b0, unsigned b1, T tag) {
    mma16816(d, a0, a2, b0, b1, tag);  // rows 8..15 of D are never computed here
}
// ldmatrix .x4: lanes 8i..8i+7 address matrix i's rows (8 16-bit values each); r[i] of lane T holds
// row T / 4, values 2 (T % 4) and 2 (T % 4) + 1 (.trans: rows 2 (T % 4) and 2 (T % 4) + 1, value T / 4).
inline void ldmatrix_impl(unsigned (&r)[4], const void* p, bool trans) {
    uint64_t rows[32];
    emu_mma::all_lanes(reinterpret_cast<uint64_t>(p), rows);
    const int T = emu::lane();
    for (int i = 0; i < 4; ++i) {
        if (!trans) {
            std::memcpy(&r[i], reinterpret_cast<const char*>(rows[8 * i + T / 4]) + 4 * (T % 4), 4);
        } else {
            uint16_t lo, hi;
            std::memcpy(&lo, reinterpret_cast<const char*>(rows[8 * i + 2 * (T % 4)]) + 2 * (T / 4), 2);
            std::memcpy(&hi, reinterpret_cast<const char*>(rows[8 * i + 2 * (T % 4) + 1]) + 2 * (T / 4), 2);
            r[i] = unsigned(lo) | (unsigned(hi) << 16);
        }
    }
}
inline void ldmatrix_x4(unsigned (&r)[4], const void* p) { ldmatrix_impl(r, p, false); }
inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) { ldmatrix_impl(r, p, true); }
inline void cp_async16(void* dst, const void* src, bool valid) {
    if (valid) std::memcpy(dst, src, 16); else std::memset(dst, 0, 16);
}
inline void cp_async_commit() {}
inline void cp_async_wait_1() {}
template <int N> inline void cp_async_wait() {}
inline void cp_async_wait_all() {}
"""  # noqa: E501 - kernel source text, kept verbatim

# sources/prefill_attention_cuda.PREFILL_HEADER's mma with all 16 rows of A: a[0] = A[g][2t..], a[1] = A[g+8][2t..],
# a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]; d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..2t+1].
EMU_PREFILL_HEADER = r"""
template <class T>
inline void mma16816_rows(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, T tag) {
    uint64_t top[32], bottom[32], b[32];
    emu_mma::all_lanes(uint64_t(a[0]) | (uint64_t(a[2]) << 32), top);
    emu_mma::all_lanes(uint64_t(a[1]) | (uint64_t(a[3]) << 32), bottom);
    emu_mma::all_lanes(uint64_t(b0) | (uint64_t(b1) << 32), b);
    const int g = emu::lane() >> 2, t = emu::lane() & 3;
    auto half = [&](const uint64_t* regs, int lane, int k) {  // lane 4 r + (k % 8) / 2 holds row r's k
        const uint64_t v = regs[lane];
        const unsigned w = unsigned(k >= 8 ? v >> 32 : v);
        return emu_mma::half_bits(k % 2 ? w >> 16 : w & 0xFFFF, tag);
    };
    for (int e = 0; e < 2; ++e) {
        float s_top = 0.f, s_bottom = 0.f;
        for (int k = 0; k < 16; ++k) {
            const float bk = half(b, 4 * (2 * t + e) + (k % 8) / 2, k);
            s_top += half(top, 4 * g + (k % 8) / 2, k) * bk;
            s_bottom += half(bottom, 4 * g + (k % 8) / 2, k) * bk;
        }
        d[e] += s_top;
        d[e + 2] += s_bottom;
    }
}
"""

# The 16-bit loop's one inline asm outside the helpers.
WAIT_ALL = 'asm volatile("cp.async.wait_all;" ::);'
