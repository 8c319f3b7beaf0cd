"""The quantized decode kernels, the prefill kernel over quantized pages (CUDA) and the quantized page writes
on a real GPU (skipped elsewhere): check.py's
quantized checks (decode rows across block and split boundaries, unsplit and split, windows and sinks; the
in-place write against a scatter, read in the same graph; the write that quantizes the rows itself against
mx.quantize on the device, bit for bit) for the head shapes of the models the issue names,
int8 and int4 at their default group sizes and at mlx-lm's 64. On CUDA both decode kernels: the tensor-core
one (the default where the 16-bit kernel runs on tensor cores) and the lanes one. (The CPU runs the same
sources in the emulator: tests/test_kv_quant_kernels.py, tests/test_kv_quant_mma_emulated.py.)"""

from __future__ import annotations

import mlx.core as mx
import pytest

from pagedmlx.kernels import build, check, decode_attention, decode_attention_quant
from pagedmlx.kernels.dialect import CUDA
from pagedmlx.core.kv.cache_dtype import KVQuant

BACKEND = build.gpu_backend()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(BACKEND is None, reason="a GPU (CUDA or Metal) runs the kernels")]

# (query heads, kv heads, head_dim, dtype): Llama-8B, Gemma-3-27B, Qwen-style GQA 7, head_dim 64 in fp16
SHAPES = [(32, 8, 128, mx.bfloat16), (32, 16, 128, mx.bfloat16), (28, 4, 128, mx.bfloat16), (8, 8, 64, mx.float16)]
QUANTS = [KVQuant(8, 128), KVQuant(8, 64), KVQuant(4, 64), KVQuant(4, 32)]
LANES = decode_attention.Settings(**{**decode_attention.SETTINGS[BACKEND or CUDA].__dict__, "mma": 0})
KERNELS = ["default", "lanes"] if BACKEND == CUDA else ["default"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: f"int{q.bits}g{q.group_size}")
@pytest.mark.parametrize("window,sinks", [(None, False), (100, True)])
def test_quantized_decode_kernel_matches_the_gather_path(kernel, shape, quant, window, sinks):
    h, n_kv, d, dt = shape
    if d % quant.group_size:
        pytest.skip("group larger than the head")
    settings = LANES if kernel == "lanes" else None
    # CUDA's default is the tensor-core kernel for every shape here
    assert decode_attention_quant.uses_tensor_cores(d, h // n_kv, dt, quant, BACKEND, settings) == (
        BACKEND == CUDA and kernel == "default")
    for bs in (16, 32):
        assert check.check_decode_quantized(BACKEND, h, n_kv, d, dt, quant, bs, window, sinks,
                                            settings=settings) is None


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: f"int{q.bits}g{q.group_size}")
def test_quantized_page_write_lands_in_place_and_is_read_in_the_same_graph(shape, quant):
    _, n_kv, d, dt = shape
    if d % quant.group_size:
        pytest.skip("group larger than the head")
    for bs in (16, 32):
        assert check.check_page_write_quantized(BACKEND, n_kv, n_kv, d, dt, quant, bs) is None
        for seed in range(3):  # the quantizing write: its parts are mx.quantize's here, bit for bit
            assert check.check_page_write_quantized(BACKEND, n_kv, n_kv, d, dt, quant, bs, seed,
                                                    quantizing=True) is None


@pytest.mark.skipif(BACKEND != CUDA, reason="the paged prefill kernel is CUDA only")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: f"int{q.bits}g{q.group_size}")
@pytest.mark.parametrize("window,sinks", [(None, False), (100, True)])
def test_quantized_prefill_kernel_matches_the_reference(shape, quant, window, sinks):
    """check.check_prefill over quantized pages (what select_quantized runs at load): segments after prefixes,
    tile, page and split boundaries, against the float64 reference over the pages' dequantized values."""
    h, n_kv, d, dt = shape
    if d % quant.group_size:
        pytest.skip("group larger than the head")
    for bs in (16, 32):
        assert check.check_prefill(h, n_kv, d, dt, bs, window, sinks, quant=quant) is None
