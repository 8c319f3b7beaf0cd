"""CUDA source of the skinny GEMM on tensor cores (sm_80+, 16-bit weights): y^T = W x^T as mma.sync m16n8k16,
W's 16-column tiles as A and x's (at most 8) rows as B's columns. kernels/skinny_gemm.py builds it where
PAGEDMLX_SKINNY_MMA=1; the lanes' kernel (sources/skinny_gemm.py) is the default.

Why it was tried: the lanes' kernel widens every value of x again for each weight row it meets (~200 ALU ops per
32 weight bytes at 8 rows: decodes of 8 requests ran 0.72x); here a 32-wide k chunk of a 16-column tile is two
mma instructions, and the loop is loads. What it gave (H100): 0.72-0.82x
cuBLASLt's device time at its default launch, 0.81-1.04x at the best of five, no better than the lanes' kernel."""

MMA_HEADER = r"""
// d (16 x 8, float) += A (16 x 16) * B (16 x 8), 16-bit inputs. Lane (g = lane / 4, t = lane % 4) holds
// a0 = A[g][2t..2t+1], a1 = A[g+8][2t..2t+1], a2 = A[g][2t+8..2t+9], a3 = A[g+8][2t+8..2t+9];
// b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..2t+1].
__device__ inline void skinny_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                  unsigned b1, __nv_bfloat16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ inline void skinny_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                  unsigned b1, __half) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""  # noqa: E501 - kernel source text, kept verbatim

SKINNY_GEMM_MMA = """
    // A thread group of WARPS warps computes one 16-column tile of y for all M rows; its warps take K's 32-wide
    // chunks in turn, UNROLL chunks a step (their loads issued before their products), and add their partial
    // tiles in shared memory at the end. Inside a chunk, lane (g, t) loads 16 contiguous bytes (8 values, k from
    // 8t) of W's rows g and g + 8 and of x's row g, and the mma's k positions are permuted alike for A and B
    // (words 0-1 the first mma, 2-3 the second): only the order of the float sums changes. x's rows past M repeat
    // its last row and W's rows past N its last; neither is written.
    const int N = w_shape[0];
    const int warp = SIMD_ID, g = LANE >> 2, t = LANE & 3;
    const int n0 = GROUP_X * 16;
    const auto* wa = w + (size_t)IMIN(n0 + g, N - 1) * K + 8 * t;
    const auto* wb = w + (size_t)IMIN(n0 + g + 8, N - 1) * K + 8 * t;
    const auto* xr = x + (size_t)IMIN(g, M - 1) * K + 8 * t;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = warp * 32 * UNROLL; k0 < K; k0 += WARPS * 32 * UNROLL) {
        uint4 av[UNROLL], bv[UNROLL], xv[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = IMIN(k0 + u * 32, K - 32);  // a chunk past K loads the last one and is skipped below
            av[u] = __ldg(reinterpret_cast<const uint4*>(wa + k));
            bv[u] = __ldg(reinterpret_cast<const uint4*>(wb + k));
            xv[u] = __ldg(reinterpret_cast<const uint4*>(xr + k));
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (k0 + u * 32 < K) {
                skinny_mma(d, av[u].x, bv[u].x, av[u].y, bv[u].y, xv[u].x, xv[u].y, T());
                skinny_mma(d, av[u].z, bv[u].z, av[u].w, bv[u].w, xv[u].z, xv[u].w, T());
            }
        }
    }
    SHARED float part[WARPS][16][9];  // [warp][column in the tile][row of x]; 9: no bank conflicts
    part[warp][g][2 * t] = d[0];
    part[warp][g][2 * t + 1] = d[1];
    part[warp][g + 8][2 * t] = d[2];
    part[warp][g + 8][2 * t + 1] = d[3];
    BARRIER();
    for (int i = THREAD_IN_GROUP; i < 16 * M; i += 32 * WARPS) {
        const int c = i & 15, m = i >> 4;
        float s = 0.0f;
        #pragma unroll
        for (int v = 0; v < WARPS; ++v) s += part[v][c][m];
        if (n0 + c < N) y[(size_t)m * N + n0 + c] = static_cast<T>(s);
    }
"""
