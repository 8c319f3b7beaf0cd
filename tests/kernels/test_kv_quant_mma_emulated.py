"""The tensor-core decode kernels on the CPU: their CUDA source with the PTX helpers emulated
(tests/kernel_emulator/mma.py: ldmatrix and mma.sync in PTX's fragment layouts, cp.async as plain copies).
The 16-bit kernel (run on the H200 by the GPU suite) matching the gather path shows the emulation right; the
quantized pages' kernel (kernels/sources/decode_attention_quant_mma_cuda.py) is then held to the gather path
over the same quantized pages, windows, sinks and splits included. What only the GPU shows: the real PTX,
nvcc's code (tests/test_cuda_sources.py compiles it) and speed."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from utils import fast_first
from kernel_emulator import EmulatedKernel, have_compiler
from kernel_emulator.mma import EMU_MMA_HEADER, WAIT_ALL
from test_kv_quant_kernels import quantized_case

from pagedmlx.kernels import build, decode_attention, decode_attention_quant
from pagedmlx.kernels.dialect import CUDA
from pagedmlx.kernels.sources import decode_attention_mma_cuda as mma_src
from pagedmlx.core.kv.cache_dtype import KVQuant
from pagedmlx.runner.attention import gather_decode
from pagedmlx.runner.kv_quant import QuantizedPages
from pagedmlx.runner.masks import length_mask

pytestmark = pytest.mark.skipif(not have_compiler(), reason="g++ runs the emulated kernels")


@pytest.fixture
def emulated_mma(monkeypatch):
    monkeypatch.setattr(build, "make_kernel", EmulatedKernel)
    monkeypatch.setattr(mma_src, "MMA_HEADER", EMU_MMA_HEADER)
    for f in (decode_attention._kernels, decode_attention_quant._kernels):
        f.cache_clear()
    yield monkeypatch
    for f in (decode_attention._kernels, decode_attention_quant._kernels):
        f.cache_clear()


def _splits(lens, window, splits):
    span = int(min(max(lens), window or max(lens)))
    tokens = -(-span // splits)
    return -(-span // tokens), mx.array([tokens], mx.int32)


@pytest.mark.parametrize("D,H,KV", [(128, 8, 2), (64, 8, 1)])
def test_emulated_16_bit_tensor_core_kernel_matches_the_gather_path(emulated_mma, D, H, KV):
    emulated_mma.setattr(mma_src, "ACCUMULATE_MMA", mma_src.ACCUMULATE_MMA.replace(WAIT_ALL, "cp_async_wait_all();"))
    rng = np.random.default_rng(5)
    lens, bs = [1, 17, 45], 16
    nb = -(-max(lens) // bs)
    k = mx.array(rng.standard_normal((len(lens) * nb + 1, KV, bs, D)).astype(np.float32)).astype(mx.bfloat16)
    v = mx.array(rng.standard_normal((len(lens) * nb + 1, KV, bs, D)).astype(np.float32)).astype(mx.bfloat16)
    table = mx.array(rng.permutation(len(lens) * nb)[: len(lens) * nb].reshape(len(lens), nb).astype(np.int32))
    q = mx.array(rng.standard_normal((len(lens), H, D)).astype(np.float32)).astype(mx.bfloat16)
    seq_lens = mx.array(np.array(lens, np.int32))
    assert decode_attention.uses_tensor_cores(D, H // KV, mx.bfloat16, CUDA)
    want = gather_decode(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), table, D ** -0.5,
                         length_mask(seq_lens, nb * bs))
    for splits in (1, 2):
        n, tokens = _splits(lens, None, splits)
        got = decode_attention.paged_decode(q, k, v, table, seq_lens, D ** -0.5, n, tokens, init_value=float("nan"),
                                            backend=CUDA)
        err = mx.abs(got.astype(mx.float32) - want).max().item()
        assert np.isfinite(err) and err < 3e-2, (splits, err)


# (dtype, D, query heads, kv heads, lengths, window, bits, group size): Llama-8B's and GQA-7's groups of heads
# (one or two kv heads: each runs alone), head_dim 64 in fp16; lengths across tiles, blocks and splits.
CASES = [(mx.bfloat16, 128, 8, 2, [1, 17, 70], 30, 8, 128), (mx.bfloat16, 128, 7, 1, [33, 5], 20, 4, 64),
         (mx.bfloat16, 128, 4, 1, [40], 16, 8, 64), (mx.float16, 64, 8, 1, [9, 50], 7, 4, 32),
         (mx.float16, 64, 2, 2, [64], 40, 8, 64)]


@pytest.mark.parametrize("dtype,D,H,KV,lens,window,bits,group", fast_first(2, CASES))
def test_emulated_quantized_tensor_core_kernel_matches_the_gather_path(emulated_mma, dtype, D, H, KV, lens, window,
                                                                       bits, group):
    quant = KVQuant(bits, group)
    assert decode_attention_quant.uses_tensor_cores(D, H // KV, dtype, quant, CUDA)
    rng = np.random.default_rng(7)
    q, k, v, table, seq_lens, sinks = quantized_case(rng, dtype, D, H, KV, lens, quant)
    tol = {mx.float16: 5e-3, mx.bfloat16: 3e-2}[dtype]
    before = len(EmulatedKernel.sources)
    for w, with_sinks in [(None, False), (window, True)]:
        s = sinks if with_sinks else None
        want = gather_decode(q, k, v, table, D ** -0.5, length_mask(seq_lens, table.shape[1] * 16, w), s)
        for splits in (1, 3):
            n, tokens = _splits(lens, w, splits)
            got = decode_attention_quant.paged_decode_quantized(q, k, v, table, seq_lens, D ** -0.5, n, tokens,
                                                                window=w, sinks=s, init_value=float("nan"),
                                                                backend=CUDA)
            err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
            assert np.isfinite(err) and err <= tol, (w, with_sinks, splits, err)
    assert any("store_piece<T, D, QBITS, AFTER>" in text for text in EmulatedKernel.sources[before:])


def test_int8_tiles_dequantized_as_before_with_scale_after_off(emulated_mma):
    """PAGEDMLX_QUANT_AFTER=0: int8 pages with one group a row take the dequantized tiles again (the launch's
    SCALE_AFTER 0), and still match the gather path."""
    emulated_mma.setenv("PAGEDMLX_QUANT_AFTER", "0")
    decode_attention_quant._launch.cache_clear()
    try:
        test_emulated_quantized_tensor_core_kernel_matches_the_gather_path(emulated_mma, *CASES[0])
        assert ("SCALE_AFTER", 0) in decode_attention_quant._launch(128, 4, 16, mx.bfloat16, KVQuant(8, 128), 0,
                                                                    False, CUDA, decode_attention.SETTINGS[CUDA])[0]
    finally:
        decode_attention_quant._launch.cache_clear()


@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=["int8g128", "int4g64"])
def test_tiles_loaded_where_used_with_prefetch_off(emulated_mma, case):
    """PAGEDMLX_QUANT_PREFETCH=0: no next tile staged in registers at D 128 (the launch's QPREFETCH 0); int8's
    scale-after tiles and int4's dequantized ones still match the gather path."""
    emulated_mma.setenv("PAGEDMLX_QUANT_PREFETCH", "0")
    decode_attention_quant._launch.cache_clear()
    try:
        before = len(EmulatedKernel.sources)
        test_emulated_quantized_tensor_core_kernel_matches_the_gather_path(emulated_mma, *case)
        assert any("QPREFETCH = 0" in text for text in EmulatedKernel.sources[before:])
    finally:
        decode_attention_quant._launch.cache_clear()


@pytest.mark.parametrize("magnitude", [1e5, 1e-30])
def test_int8_keys_scaled_after_the_products_take_queries_outside_fp16s_range(emulated_mma, magnitude):
    """int8 keys with one group a row take their products in fp16 (AFTER in the kernel's source): a bf16
    query far above fp16's largest value or below its smallest is scaled by a power of two into its range,
    so the output still matches the gather path (which multiplies in float32). The softmax scale undoes the
    magnitude, so the scores are the ordinary case's."""
    from pagedmlx.kernels.sources import decode_attention_quant_mma_cuda as qmma_src

    assert "QBITS == 8 && QGROUP == D" in qmma_src._AFTER_SETUP
    D, H, KV, lens, quant = 128, 8, 2, [17, 70], KVQuant(8, 128)
    q, k, v, table, seq_lens, _ = quantized_case(np.random.default_rng(3), mx.bfloat16, D, H, KV, lens, quant)
    q = (q.astype(mx.float32) * magnitude).astype(mx.bfloat16)
    scale = D ** -0.5 / magnitude
    want = gather_decode(q.astype(mx.float32), k, v, table, scale, length_mask(seq_lens, table.shape[1] * 16))
    n, tokens = _splits(lens, None, 1)
    got = decode_attention_quant.paged_decode_quantized(q, k, v, table, seq_lens, scale, n, tokens,
                                                        init_value=float("nan"), backend=CUDA)
    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    assert np.isfinite(err) and err <= 3e-2, err


@pytest.mark.parametrize("magnitude", [3e4, 1e-20])
def test_int8_values_scaled_after_the_products_keep_their_magnitude(emulated_mma, magnitude):
    """The values' weights p s / S are in fp16 with S a power of two under the largest |s|: pages whose values
    (and so scales) are far above fp16's range or far below it still give the gather path's output, relative
    to their magnitude. Keys scaled the same way, the softmax scale undoing it."""
    D, H, KV, lens, quant = 128, 8, 2, [9, 70], KVQuant(8, 128)
    rng = np.random.default_rng(11)
    q, _, _, table, seq_lens, _ = quantized_case(rng, mx.bfloat16, D, H, KV, lens, quant)
    nb = table.shape[1]
    pages = [mx.array(rng.standard_normal((len(lens) * nb + 2, KV, 16, D)).astype(np.float32) * magnitude)
             .astype(mx.bfloat16) for _ in range(2)]
    k, v = (QuantizedPages(*mx.quantize(p, group_size=128, bits=8), quant) for p in pages)
    scale = D ** -0.5 / magnitude
    want = gather_decode(q.astype(mx.float32), k, v, table, scale, length_mask(seq_lens, nb * 16))
    n, tokens = _splits(lens, None, 2)
    got = decode_attention_quant.paged_decode_quantized(q, k, v, table, seq_lens, scale, n, tokens,
                                                        init_value=float("nan"), backend=CUDA)
    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() / magnitude
    assert np.isfinite(err) and err <= 3e-2, err


@pytest.mark.parametrize("quant,window,sinks", [(KVQuant(8, 128), None, False), (KVQuant(4, 64), 100, True)])
def test_the_load_time_check_passes_the_emulated_kernel_for_llama_8b_heads(emulated_mma, quant, window, sinks):
    """check.check_decode_quantized (what select_quantized runs at load) on CUDA's default, the tensor-core
    kernel, with Llama-8B's heads; and check.check_page_write_quantized reading through it."""
    from pagedmlx.kernels import check, page_write

    emulated_mma.setattr(page_write, "_quant_write_kernel", page_write._quant_write_kernel.__wrapped__)
    assert decode_attention_quant.uses_tensor_cores(128, 4, mx.bfloat16, quant, CUDA)
    assert check.check_decode_quantized(CUDA, 32, 8, 128, mx.bfloat16, quant, 16, window, sinks) is None
    assert check.check_page_write_quantized(CUDA, 8, 8, 128, mx.bfloat16, quant, 16) is None


_TILE_STORE = """
    constexpr int WORDS = D * QBITS / 32, GROUPS = D / QGROUP, PPR = WORDS / 4;
    const int lane = threadIdx.x;
    for (int c = lane; c < 16 * PPR; c += 32) {
        const int row = c / PPR, piece = c % PPR;
        const uint4 raw = reinterpret_cast<const uint4*>(packed + row * WORDS)[piece];
        const int gi = row * GROUPS + piece * (128 / QBITS) / QGROUP;
        store_piece<T, D, QBITS>(tile, row, piece, raw, pair_bits(scales[gi], biases[gi]));
    }
"""


@pytest.mark.parametrize("dtype,D,bits,group", [(mx.bfloat16, 128, 8, 128), (mx.bfloat16, 128, 8, 64),
                                                (mx.bfloat16, 64, 4, 32), (mx.float16, 128, 8, 128),
                                                (mx.float16, 128, 4, 64)])
def test_the_tile_store_dequantizes_within_a_rounding(emulated_mma, dtype, D, bits, group):
    """store_piece, the dequantization both quantized tensor-core kernels share, against q * s + b in float64
    rounded to the model's dtype: within one of its roundings plus s / 256 (bf16 int8 folds 2^15 * s into its
    bias, whose own rounding is at most s / 512), and never further off than mx.dequantize itself is (which
    rounds q * s before adding b). Scales from 1e-3 to 40, biases of both signs, every code."""
    from pagedmlx.kernels.sources import decode_attention_quant_mma_cuda as qmma_src

    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, D)) * rng.choice([1e-3, 0.1, 3.0, 40.0], (16, 1)) + rng.normal(0, 2, (16, 1))
    packed, scales, biases = mx.quantize(mx.array(x.astype(np.float32)).astype(dtype), group_size=group, bits=bits)
    kernel = EmulatedKernel("cuda", "tile_store", ["packed", "scales", "biases"], ["tile"], _TILE_STORE,
                            EMU_MMA_HEADER + qmma_src.QUANT_MMA_HEADER)
    (tile,) = kernel(inputs=[packed, scales, biases],
                     template=[("T", dtype), ("D", D), ("QBITS", bits), ("QGROUP", group)],
                     grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(16 * D,)], output_dtypes=[dtype])
    chunks = np.arange(D // 8)
    flat = np.array(tile.astype(mx.float32)).astype(np.float64)
    got = np.stack([flat[r * D + ((chunks ^ (r & 7))[:, None] * 8 + np.arange(8)).reshape(-1)]  # un-swizzled
                    for r in range(16)])
    per = 32 // bits
    codes = (np.array(packed)[:, np.arange(D) // per] >> (bits * (np.arange(D) % per))) & ((1 << bits) - 1)
    s = np.repeat(np.array(scales.astype(mx.float32)).astype(np.float64), group, axis=1)
    b = np.repeat(np.array(biases.astype(mx.float32)).astype(np.float64), group, axis=1)
    exact = codes * s + b
    mxd = np.array(mx.dequantize(packed, scales, biases, group_size=group, bits=bits).astype(mx.float32))
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(exact), 2.0 ** -14))) - (7 if dtype == mx.bfloat16 else 10))
    assert np.all(np.abs(got - exact) <= ulp + np.abs(s) / 256)
    assert np.all(np.abs(got - exact) <= np.abs(mxd - exact) + ulp)
