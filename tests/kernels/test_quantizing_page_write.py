"""The page write that quantizes the step's rows itself (kernels/page_write.py: reshape_and_cache_quantizing),
without a GPU: its CUDA and Metal sources run in the emulator and write, bit for bit, what MLX's GPU quantizer
gives (tests/kv_quant_reference.py), whose formula is anchored here against this machine's mx.quantize; the
load-time check (kernels/check.py) fails a write whose arithmetic drifts from the device's mx.quantize."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kernel_emulator import EmulatedKernel, have_compiler
from kv_quant_reference import gpu_quantize

from pagedmlx.kernels import build, check, decode_attention, decode_attention_quant, page_write
from pagedmlx.kernels.dialect import CUDA, METAL, foreign_names, leftover_tokens, render
from pagedmlx.kernels.sources import page_write as src
from pagedmlx.core.kv.cache_dtype import KVQuant

needs_compiler = pytest.mark.skipif(not have_compiler(), reason="g++ runs the emulated kernels")
QUANTS = [KVQuant(8, 128), KVQuant(8, 64), KVQuant(8, 32), KVQuant(4, 64), KVQuant(4, 32)]


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(build, "make_kernel", EmulatedKernel)
    caches = (decode_attention_quant._kernels, decode_attention._kernels, page_write._quantizing_write_kernel)
    for f in caches:
        f.cache_clear()
    yield
    for f in caches:
        f.cache_clear()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("quant", QUANTS, ids=str)
def test_the_reference_is_mx_quantize_with_the_gpus_rounding(dtype, quant):
    """With round-half-to-even and a max taken from the values (what MLX's CPU quantizer does), the reference
    gives this machine's mx.quantize bit for bit: the rest of its formula is MLX's."""
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((40, 4, 128)).astype(np.float32) * 3).astype(dtype)
    want = mx.quantize(x, group_size=quant.group_size, bits=quant.bits)
    got = gpu_quantize(x, quant.group_size, quant.bits, rounding=np.rint, max_from_zero=False)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and np.array_equal(np.array(w.astype(mx.float32)), np.array(g.astype(mx.float32)))


def test_sources_render_for_both_backends():
    for backend in (CUDA, METAL):
        text = render(src.RESHAPE_AND_CACHE_QUANTIZING, backend)
        assert not leftover_tokens(text) and not foreign_names(text, backend)
    assert "roundf(" in render(src.RESHAPE_AND_CACHE_QUANTIZING, CUDA)
    assert "metal::round(" in render(src.RESHAPE_AND_CACHE_QUANTIZING, METAL)


@needs_compiler
@pytest.mark.parametrize("backend,dtype,d,quant", [(METAL, mx.bfloat16, 128, KVQuant(8, 128)),
                                                   (METAL, mx.bfloat16, 64, KVQuant(4, 64)),
                                                   (METAL, mx.float16, 64, KVQuant(4, 32)),
                                                   (CUDA, mx.float32, 128, KVQuant(8, 128)),
                                                   (CUDA, mx.float32, 64, KVQuant(8, 32)),
                                                   (CUDA, mx.float32, 64, KVQuant(4, 64))])
def test_emulated_write_is_the_gpu_quantizers_and_the_cpu_one_fails_its_check(emulated, backend, dtype, d, quant):
    """The check's rows include groups all negative, all zero, constant and tiny. Against the GPU's
    quantizer the write passes bit for bit, three seeds; against this CPU's mx.quantize (another rounding,
    another max for a negative group) the check fails and names what differs."""
    def reference(x):
        return gpu_quantize(x, quant.group_size, quant.bits)

    for seed in range(3):
        assert check.check_page_write_quantized(backend, 2, 2, d, dtype, quant, 8, seed, quantizing=True,
                                                quantize=reference) is None
    err = check.check_page_write_quantized(backend, 2, 2, d, dtype, quant, 8, quantizing=True)
    assert err is not None and "differ from a scatter of mx.quantize's parts" in err


@needs_compiler
def test_a_write_whose_formula_drifts_fails_the_check(emulated, monkeypatch):
    """A group's max taken from its values (the CPU's rule) instead of from 0: only the all-negative group
    changes, and the check sees it."""
    drifted = src.RESHAPE_AND_CACHE_QUANTIZING.replace("w_max = 0.0f", "w_max = -BITS_FLOAT(0x7f7fffffu)")
    assert drifted != src.RESHAPE_AND_CACHE_QUANTIZING
    monkeypatch.setattr(src, "RESHAPE_AND_CACHE_QUANTIZING", drifted)
    quant = KVQuant(8, 32)
    err = check.check_page_write_quantized(METAL, 2, 2, 64, mx.bfloat16, quant, 8, quantizing=True,
                                           quantize=lambda x: gpu_quantize(x, 32, 8))
    assert err is not None and "keys" in err and "differ" in err


@needs_compiler
@pytest.mark.parametrize("quant", [KVQuant(8, 64), KVQuant(4, 32)], ids=str)
def test_rows_in_another_dtype_are_quantized_in_the_pages_dtype(emulated, quant):
    """float32 keys and values into bfloat16 pages: quantized as mx.quantize of the rows cast to bfloat16
    (what quantize_rows does before mx.quantize); rows of negative slots are skipped."""
    rng = np.random.default_rng(3)
    T, n_kv, d, bs, blocks = 5, 2, 64, 4, 3
    rows = [mx.array(rng.standard_normal((T, n_kv, 1, d)).astype(np.float32)) for _ in range(2)]
    pages = [tuple(mx.zeros(a.shape, a.dtype) for a in gpu_quantize(mx.zeros((blocks, n_kv, bs, d), mx.bfloat16),
                                                                  quant.group_size, quant.bits)) for _ in range(2)]
    slots = mx.array([5, 0, -1, 11, 6], mx.int32)
    written = page_write.reshape_and_cache_quantizing(*rows, *pages, slots, quant, backend=METAL)
    mx.eval(written, pages)
    for side, x in zip(pages, rows):
        want = gpu_quantize(x[:, :, 0].astype(mx.bfloat16), quant.group_size, quant.bits)
        for page, part in zip(side, want):
            page = page.transpose(0, 2, 1, 3).reshape(blocks * bs, n_kv, -1)  # pages are head-major: slot-major here
            flat = np.array(page.astype(mx.float32) if page.dtype != mx.uint32 else page)
            part = np.array(part.astype(mx.float32) if part.dtype != mx.uint32 else part)
            for t, s in enumerate(np.array(slots)):
                if s >= 0:
                    assert np.array_equal(flat[s], part[t])
            untouched = np.setdiff1d(np.arange(blocks * bs), np.array(slots)[np.array(slots) >= 0])
            assert not flat[untouched].any()


def test_shapes_it_does_not_take_are_refused():
    k = mx.zeros((1, 1, 1, 48))
    pages = (mx.zeros((1, 1, 4, 12), mx.uint32), mx.zeros((1, 1, 4, 1)), mx.zeros((1, 1, 4, 1)))
    with pytest.raises(ValueError, match="groups of a multiple of 32"):
        page_write.reshape_and_cache_quantizing(k, k, pages, pages, mx.zeros((1,), mx.int32), KVQuant(8, 48))
