"""Numpy emulation of the tensor-core kernels' fragment addressing: the decode kernel's for one
16-token tile (kernels/sources/decode_attention_mma_cuda.py), and the prefill kernel's for one stage
of KT keys with all 16 query rows, P taken from S's accumulators (kernels/sources/prefill_attention_cuda.py).

It stores K and V tiles as load() does (16-byte chunks swizzled by row), reads them back with the
kernel's ldmatrix addresses under PTX's m8n8 (and .trans) layouts, multiplies with mma m16n8k16
layouts and compares with Q K^T and P V. Edit it with the kernel: it copies the kernel's index math.
"""
import numpy as np
import pytest


def _store(M: np.ndarray, D: int) -> np.ndarray:
    """A K or V tile in shared memory as load() stores it: 16-byte chunks swizzled by row."""
    sm = np.zeros(M.shape[0] * D)
    for row in range(M.shape[0]):
        for chunk in range(D // 8):
            dst = row * D + ((chunk ^ (row & 7)) * 8)
            sm[dst:dst + 8] = M[row, chunk * 8:chunk * 8 + 8]
    return sm


def _ldmatrix(sm: np.ndarray, addr_of_lane, trans: bool = False) -> np.ndarray:
    """ldmatrix.x4 (.trans): lanes 8i..8i+7 give matrix i's row addresses; regs (lane, matrix, pair)."""
    regs = np.zeros((32, 4, 2))
    for i in range(4):
        mat = np.stack([sm[addr_of_lane(8 * i + r):addr_of_lane(8 * i + r) + 8] for r in range(8)])
        for T in range(32):
            regs[T, i] = mat[T // 4, 2 * (T % 4):2 * (T % 4) + 2] if not trans else \
                [mat[2 * (T % 4), T // 4], mat[2 * (T % 4) + 1, T // 4]]
    return regs


def _mma_rows(dacc: np.ndarray, a: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """m16n8k16 with all 16 rows: a (32, 4, 2) per-lane pairs a[0..3], b0, b1 (32, 2); dacc (32, 4)."""
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for T in range(32):
        g, t = T >> 2, T & 3
        A[g, 2 * t:2 * t + 2] = a[T, 0]; A[g + 8, 2 * t:2 * t + 2] = a[T, 1]
        A[g, 2 * t + 8:2 * t + 10] = a[T, 2]; A[g + 8, 2 * t + 8:2 * t + 10] = a[T, 3]
        B[2 * t:2 * t + 2, g] = b0[T]; B[2 * t + 8:2 * t + 10, g] = b1[T]
    Dm = A @ B
    out = dacc.copy()
    for T in range(32):
        g, t = T >> 2, T & 3
        out[T, 0:2] += Dm[g, 2 * t:2 * t + 2]; out[T, 2:4] += Dm[g + 8, 2 * t:2 * t + 2]
    return out


def check(D: int, G: int) -> tuple[float, float]:
    """One 16-token tile of the decode kernel: G query rows (the rest zero), A's rows 8..15 zero."""
    rng = np.random.default_rng(0)
    KS, NT = D // 16, D // 8
    K = rng.standard_normal((16, D)); V = rng.standard_normal((16, D)); Q = rng.standard_normal((G, D))
    kt, vt = _store(K, D), _store(V, D)
    zero = np.zeros((32, 2))

    def mma(dacc, a0, a2, b0, b1):  # the decode kernel passes zeros for rows 8..15 (a1, a3)
        return _mma_rows(dacc, np.stack([a0, zero, a2, zero], axis=1), b0, b1)
    # Q fragments
    qa = np.zeros((32, KS, 2, 2))
    for T in range(32):
        g, t = T >> 2, T & 3
        for k in range(KS):
            if g < G:
                qa[T, k, 0] = Q[g, 16 * k + 2 * t:16 * k + 2 * t + 2]
                qa[T, k, 1] = Q[g, 16 * k + 2 * t + 8:16 * k + 2 * t + 10]
    s = np.zeros((2, 32, 4))
    for j in range(2):
        for p in range(KS // 2):
            def addr(l, j=j, p=p):
                row = 8 * j + (l & 7); chunk = 4 * p + (l >> 3)
                return row * D + ((chunk ^ (row & 7)) * 8)
            kb = _ldmatrix(kt, addr)
            s[j] = mma(s[j], qa[:, 2 * p, 0], qa[:, 2 * p, 1], kb[:, 0], kb[:, 1])
            s[j] = mma(s[j], qa[:, 2 * p + 1, 0], qa[:, 2 * p + 1, 1], kb[:, 2], kb[:, 3])
    S_want = Q @ K.T  # (G, 16)
    err = 0
    for T in range(32):
        g, t = T >> 2, T & 3
        if g < G:
            for j in range(2):
                for e in range(2):
                    err = max(err, abs(s[j][T, e] - S_want[g, 8 * j + 2 * t + e]))
    qk_err = err
    # PV with P = some weights in S's accumulator layout
    P = rng.random((G, 16))
    pa0 = np.zeros((32, 2)); pa2 = np.zeros((32, 2))
    for T in range(32):
        g, t = T >> 2, T & 3
        if g < G:
            pa0[T] = P[g, 2 * t:2 * t + 2]; pa2[T] = P[g, 8 + 2 * t:8 + 2 * t + 2]
    acc = np.zeros((NT, 32, 4))
    for n in range(0, NT, 2):
        def addr(l, n=n):
            row = ((l >> 3) & 1) * 8 + (l & 7); chunk = n + (l >> 4)
            return row * D + ((chunk ^ (row & 7)) * 8)
        vb = _ldmatrix(vt, addr, trans=True)
        acc[n] = mma(acc[n], pa0, pa2, vb[:, 0], vb[:, 1])
        acc[n + 1] = mma(acc[n + 1], pa0, pa2, vb[:, 2], vb[:, 3])
    O_want = P @ V
    err = 0
    for T in range(32):
        g, t = T >> 2, T & 3
        if g < G:
            for n in range(NT):
                for e in range(2):
                    err = max(err, abs(acc[n][T, e] - O_want[g, 8 * n + 2 * t + e]))
    return qk_err, err


def check_prefill(D: int) -> tuple[float, float]:
    """One warp's stage in the prefill kernel: 16 query rows, KT = 4096 / D keys."""
    rng = np.random.default_rng(1)
    KT, KS, NT = 4096 // D, D // 16, D // 8
    NJ = KT // 8
    Q = rng.standard_normal((16, D)); K = rng.standard_normal((KT, D)); V = rng.standard_normal((KT, D))
    kt, vt = _store(K, D), _store(V, D)
    qa = np.zeros((32, KS, 4, 2))  # the kernel's qa[k][0..3]: rows g, g + 8; dims 16k + 2t (+8)
    for T in range(32):
        g, t = T >> 2, T & 3
        for k in range(KS):
            qa[T, k] = [Q[g, 16 * k + 2 * t:16 * k + 2 * t + 2], Q[g + 8, 16 * k + 2 * t:16 * k + 2 * t + 2],
                        Q[g, 16 * k + 2 * t + 8:16 * k + 2 * t + 10], Q[g + 8, 16 * k + 2 * t + 8:16 * k + 2 * t + 10]]
    s = np.zeros((NJ, 32, 4))
    for j in range(NJ):
        for p in range(KS // 2):
            def addr(lane, j=j, p=p):
                row, chunk = 8 * j + (lane & 7), 4 * p + (lane >> 3)
                return row * D + ((chunk ^ (row & 7)) * 8)
            kb = _ldmatrix(kt, addr)
            s[j] = _mma_rows(s[j], qa[:, 2 * p], kb[:, 0], kb[:, 1])
            s[j] = _mma_rows(s[j], qa[:, 2 * p + 1], kb[:, 2], kb[:, 3])
    S_want = Q @ K.T
    qk_err = max(abs(s[j][T, e] - S_want[(T >> 2) + 8 * (e >= 2), 8 * j + 2 * (T & 3) + e % 2])
                 for j in range(NJ) for T in range(32) for e in range(4))
    P = rng.random((16, KT))  # weights in S's accumulator layout, as the kernel leaves them in s
    for j in range(NJ):
        for T in range(32):
            for e in range(4):
                s[j][T, e] = P[(T >> 2) + 8 * (e >= 2), 8 * j + 2 * (T & 3) + e % 2]
    acc = np.zeros((NT, 32, 4))
    for kk in range(KT // 16):
        pa = np.stack([s[2 * kk][:, 0:2], s[2 * kk][:, 2:4], s[2 * kk + 1][:, 0:2], s[2 * kk + 1][:, 2:4]], axis=1)
        for n in range(0, NT, 2):
            def addr(lane, n=n, kk=kk):
                row, chunk = 16 * kk + ((lane >> 3) & 1) * 8 + (lane & 7), n + (lane >> 4)
                return row * D + ((chunk ^ (row & 7)) * 8)
            vb = _ldmatrix(vt, addr, trans=True)
            acc[n] = _mma_rows(acc[n], pa, vb[:, 0], vb[:, 1])
            acc[n + 1] = _mma_rows(acc[n + 1], pa, vb[:, 2], vb[:, 3])
    O_want = P @ V
    pv_err = max(abs(acc[n][T, e] - O_want[(T >> 2) + 8 * (e >= 2), 8 * n + 2 * (T & 3) + e % 2])
                 for n in range(NT) for T in range(32) for e in range(4))
    return qk_err, pv_err


@pytest.mark.parametrize("D,G", [(64, 8), (128, 4), (256, 8)])
def test_decode_fragments_give_qk_and_pv(D, G):
    """The decode kernel's tile: its ldmatrix addresses, swizzle and mma.sync layouts give Q K^T and P V."""
    assert max(check(D, G)) < 1e-9


@pytest.mark.parametrize("D", [64, 128])  # prefill_attention.PREFILL_HEAD_DIMS
def test_prefill_fragments_give_qk_and_pv_for_all_16_rows(D):
    """The prefill kernel's stage: Q K^T and P V for all 16 rows of a warp, P from S's accumulators."""
    assert max(check_prefill(D)) < 1e-9


def _store_quantized(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, D: int, bits: int,
                     group: int) -> np.ndarray:
    """A tile of 16 quantized rows as the quantized tensor-core kernel stores it
    (sources/decode_attention_quant_mma_cuda.py: fetch_piece, then store_piece), lane by lane, in float32
    (the kernel's fmaf before its rounding to T). packed (16, D * bits / 32) uint32; scales, biases (16, D / group)."""
    words, groups = D * bits // 32, D // group
    ppr = words // 4
    n_pieces, per, cpp, mask = 16 * ppr // 32, 32 // bits, 128 // bits // 8, (1 << bits) - 1
    assert packed.shape == (16, words) and scales.shape == (16, groups)
    flat, sflat, bflat = packed.reshape(-1), scales.reshape(-1), biases.reshape(-1)
    sm = np.full(16 * D, np.nan)
    for lane in range(32):
        for i in range(n_pieces):
            c = lane + 32 * i
            row, piece = c // ppr, c % ppr
            raw = flat[row * words + 4 * piece:row * words + 4 * piece + 4]  # uint4 at word 4 * piece
            gi = row * groups + piece * (128 // bits) // group
            s, b = np.float32(sflat[gi]), np.float32(bflat[gi])
            for j in range(cpp):
                vals = []
                for e in range(8):
                    ch = 8 * j + e
                    q = (int(raw[ch // per]) >> (bits * (ch % per))) & mask
                    vals.append(np.float32(q) * s + b)
                chunk = piece * cpp + j
                dst = row * D + ((chunk ^ (row & 7)) * 8)
                sm[dst:dst + 8] = vals
    return sm


@pytest.mark.parametrize("D,bits,group", [(64, 4, 32), (64, 8, 64), (128, 8, 128), (128, 8, 64), (128, 4, 64),
                                          (128, 4, 32), (256, 8, 128), (256, 4, 64)])
def test_quantized_tile_store_dequantizes_into_the_tile_ldmatrix_reads(D, bits, group):
    """The quantized kernel's pieces, groups and swizzle leave the tile load() leaves for the same rows
    dequantized (mx.dequantize), so the fragment addressing tested above reads them as it reads 16-bit tiles."""
    import mlx.core as mx

    x = mx.array(np.random.default_rng(2).standard_normal((16, D)).astype(np.float32))
    packed, scales, biases = mx.quantize(x, group_size=group, bits=bits)
    want = _store(np.array(mx.dequantize(packed, scales, biases, group_size=group, bits=bits)), D)
    got = _store_quantized(np.array(packed), np.array(scales), np.array(biases), D, bits, group)
    assert np.abs(got - want).max() < 1e-5
