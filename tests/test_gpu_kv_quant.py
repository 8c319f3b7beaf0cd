"""The quantized decode kernel on a real GPU (skipped elsewhere): check.py's quantized check (decode rows
across block and split boundaries, unsplit and split, windows and sinks) for the head shapes of the
models the issue names, int8 and int4 at their default group sizes and at mlx-lm's 64. (The CPU runs
the same source in the emulator: tests/test_kv_quant_kernels.py.)"""

from __future__ import annotations

import mlx.core as mx
import pytest

from pagedmlx.kernels import build, check
from pagedmlx.kv_cache_dtype import KVQuant

BACKEND = build.gpu_backend()
pytestmark = pytest.mark.skipif(BACKEND is None, reason="a GPU (CUDA or Metal) runs the kernels")

# (query heads, kv heads, head_dim, dtype): Llama-8B, Gemma-3-27B, Qwen-style GQA 7, head_dim 64 in fp16
SHAPES = [(32, 8, 128, mx.bfloat16), (32, 16, 128, mx.bfloat16), (28, 4, 128, mx.bfloat16), (8, 8, 64, mx.float16)]
QUANTS = [KVQuant(8, 128), KVQuant(8, 64), KVQuant(4, 64), KVQuant(4, 32)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("quant", QUANTS, ids=str)
@pytest.mark.parametrize("window,sinks", [(None, False), (100, True)])
def test_quantized_decode_kernel_matches_the_gather_path(shape, quant, window, sinks):
    h, n_kv, d, dt = shape
    if d % quant.group_size:
        pytest.skip("group larger than the head")
    for bs in (16, 32):
        assert check.check_decode_quantized(BACKEND, h, n_kv, d, dt, quant, bs, window, sinks) is None
