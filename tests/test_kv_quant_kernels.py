"""The quantized decode kernel (kernels/decode_attention_quant.py) without a GPU: its CUDA and Metal
sources run on the CPU (tests/kernel_emulator) and match the portable path over the same quantized
pages (gather, dequantize, SDPA), windows, sinks and splits included; its text is the 16-bit loop's
with every replacement applied."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kernel_emulator import EmulatedKernel, have_compiler

from pagedmlx.kernels import build, decode_attention, decode_attention_quant
from pagedmlx.kernels.dialect import CUDA, METAL, foreign_names, leftover_tokens
from pagedmlx.kernels.sources import decode_attention as src
from pagedmlx.kernels.sources import decode_attention_quant as qsrc
from pagedmlx.kv_cache_dtype import KVQuant
from pagedmlx.runner.attention import gather_decode
from pagedmlx.runner.kv_quant import QuantizedPages
from pagedmlx.runner.masks import length_mask

needs_compiler = pytest.mark.skipif(not have_compiler(), reason="g++ runs the emulated kernels")


def test_sources_render_for_both_backends():
    for backend in (CUDA, METAL):
        for body, header in decode_attention_quant.quant_decode_sources(backend).values():
            text = header + body
            assert not leftover_tokens(text)
            assert not foreign_names(text, backend), foreign_names(text, backend)
            assert "dequant_row<VEC, NV, QBITS>(kraw[u], kf)" in text


def test_a_loop_the_replacements_do_not_fit_is_refused():
    with pytest.raises(ValueError, match="must follow it"):
        qsrc.quantized_accumulate(src.ACCUMULATE.replace("uint4 kraw[U][NV]", "uint4 kraw[NV][U]"))


def quantized_case(rng, dtype, D, H, KV, lens, quant: KVQuant, bs=16):
    nb = -(-int(max(lens)) // bs)
    num_blocks = len(lens) * nb + 2

    def pages():
        x = mx.array(rng.standard_normal((num_blocks, KV, bs, D)).astype(np.float32)).astype(dtype)
        return QuantizedPages(*mx.quantize(x, group_size=quant.group_size, bits=quant.bits), quant)

    table = mx.array(rng.permutation(num_blocks)[: len(lens) * nb].reshape(len(lens), nb).astype(np.int32))
    q = mx.array(rng.standard_normal((len(lens), H, D)).astype(np.float32)).astype(dtype)
    sinks = mx.array(rng.standard_normal(H).astype(np.float32) * 2)
    return q, pages(), pages(), table, mx.array(np.asarray(lens, np.int32)), sinks


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(build, "make_kernel", EmulatedKernel)
    decode_attention_quant._kernels.cache_clear()
    decode_attention._kernels.cache_clear()
    yield
    decode_attention_quant._kernels.cache_clear()
    decode_attention._kernels.cache_clear()


# (dtype, D, query heads, kv heads, lengths, window, bits, group size)
CASES = [(mx.bfloat16, 128, 8, 2, [1, 17, 70], 30, 8, 128), (mx.bfloat16, 128, 4, 2, [5, 40], 16, 4, 64),
         (mx.float16, 64, 4, 4, [9, 33], 7, 4, 32), (mx.float16, 64, 2, 1, [20], 12, 8, 64)]


@needs_compiler
@pytest.mark.parametrize("backend", [METAL, CUDA])
@pytest.mark.parametrize("dtype,D,H,KV,lens,window,bits,group", CASES)
def test_emulated_quantized_kernel_matches_the_gather_path(emulated, backend, dtype, D, H, KV, lens, window,
                                                           bits, group):
    quant = KVQuant(bits, group)
    assert decode_attention_quant.refusal(D, D, H, KV, dtype, quant, backend) is None
    rng = np.random.default_rng(3)
    q, k, v, table, seq_lens, sinks = quantized_case(rng, dtype, D, H, KV, lens, quant)
    tol = {mx.float16: 5e-3, mx.bfloat16: 3e-2}[dtype]
    for w, with_sinks in [(None, False), (window, True)]:
        s = sinks if with_sinks else None
        want = gather_decode(q, k, v, table, D ** -0.5, length_mask(seq_lens, table.shape[1] * 16, w), s)
        span = min(max(lens), w or max(lens))
        for splits in (1, 3):
            tokens = -(-span // splits)
            got = decode_attention_quant.paged_decode_quantized(
                q, k, v, table, seq_lens, D ** -0.5, -(-span // tokens), mx.array([tokens], mx.int32), window=w,
                sinks=s, init_value=float("nan"), backend=backend)
            err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
            assert np.isfinite(err) and err <= tol, (w, with_sinks, splits, err)


def test_refusals():
    assert "whole words" in decode_attention_quant.refusal(128, 128, 8, 2, mx.float32, KVQuant(4, 64), CUDA)
    assert decode_attention_quant.refusal(128, 64, 8, 2, mx.bfloat16, KVQuant(8, 64), CUDA) is not None
