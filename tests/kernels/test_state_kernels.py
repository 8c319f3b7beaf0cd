"""The recurrent-state CUDA kernels (kernels/recurrent_state.py) against the portable path, through their
own launch code: the gated delta rule against mlx-lm's gated_delta_ops (decode batches and prefill
chunks, scalar and vector gates), the depthwise convolution against nn.Conv1d, and the in-place state
write against a scatter. Outputs are poisoned with NaN, so an element a kernel never writes fails.

Each check runs twice where it can: on the CPU, the CUDA source run by the kernel emulator
(tests/kernel_emulator, g++) on small shapes; on a CUDA GPU (skipped elsewhere), the real kernels on
Qwen3.5-27B's and 35B-A3B's head shapes (16 key heads, 48 or 32 value heads, 128 x 128) and odd ones,
the state write also while another reference to the pool is alive and read back by a later graph.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from utils import fast_first
from kernel_emulator import EmulatedKernel, have_compiler

from pagedmlx.kernels import build, recurrent_state
from pagedmlx.kernels.dialect import CUDA

TOL = {mx.float32: 2e-3, mx.float16: 2e-2, mx.bfloat16: 4e-2}
ON_CUDA = build.gpu_backend() == CUDA
# (B, T, Hk, Hv, Dk, Dv): on the GPU, Qwen3.5-27B's linear attention (16 key heads, 48 value heads,
# 128 x 128), 35B-A3B's (16, 32), and odd sizes; emulated, small ones (a C++ fiber per CUDA thread).
GPU_SHAPES = [(64, 1, 16, 48, 128, 128), (1, 512, 16, 48, 128, 128), (1, 2048, 16, 32, 128, 128),
              (7, 1, 16, 32, 128, 128), (3, 5, 2, 4, 64, 24), (2, 33, 1, 1, 256, 64)]
EMULATED_SHAPES = [(3, 1, 2, 4, 32, 8), (1, 6, 1, 2, 64, 12), (2, 3, 2, 2, 32, 5)]


@pytest.fixture(params=["emulated", "gpu"])
def device(request, monkeypatch):
    """"emulated": build.make_kernel gives the kernel emulator's stand-ins (needs g++); "gpu": the
    real kernels (needs a CUDA GPU)."""
    if request.param == "gpu" and not ON_CUDA:
        pytest.skip("a CUDA GPU runs the kernels")
    if request.param == "emulated":
        if not have_compiler():
            pytest.skip("g++ runs the emulated kernels")
        monkeypatch.setattr(build, "make_kernel", EmulatedKernel)
    recurrent_state._kernel.cache_clear()
    yield request.param
    recurrent_state._kernel.cache_clear()


def rel(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    if mx.isnan(got).any().item():
        return float("inf")
    return (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()


def inputs(B, T, Hk, Hv, Dk, Dv, dtype, vec=False):
    from mlx_lm.models.gated_delta import normalize_qk

    q, k = (mx.random.normal((B, T, Hk, Dk)).astype(dtype) for _ in range(2))
    q, k = normalize_qk(q, k, inv_scale=Dk ** -0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv)).astype(dtype)
    g = mx.random.uniform(0.8, 1.0, (B, T, Hv, Dk) if vec else (B, T, Hv))
    beta = mx.random.uniform(0, 1, (B, T, Hv)).astype(dtype)
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("dtype", fast_first(1, [mx.float32, mx.bfloat16], unpack=False))
@pytest.mark.parametrize("vec", [False, True])
def test_gated_delta_matches_mlx_lm(device, dtype, vec):
    from mlx_lm.models.gated_delta import gated_delta_ops

    mx.random.seed(0)
    for shape in GPU_SHAPES if device == "gpu" else EMULATED_SHAPES:
        args = inputs(*shape, dtype, vec)
        want = gated_delta_ops(*args)
        got = recurrent_state.gated_delta(*args, init_value=float("nan"))
        err = max(rel(got[0], want[0]), rel(got[1], want[1]))
        assert err <= TOL[dtype], (shape, err)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_depthwise_conv_matches_conv1d(device, dtype):
    mx.random.seed(1)
    cases = (((10240, 4, False, 64, 4), (10240, 4, False, 1, 515), (96, 4, True, 5, 11)) if device == "gpu"
             else ((40, 4, True, 3, 9), (40, 4, False, 2, 6)))
    for C, K, bias, B, L in cases:
        conv = nn.Conv1d(C, C, K, groups=C, bias=bias)
        conv.set_dtype(dtype)
        x = mx.random.normal((B, L, C)).astype(dtype)
        err = rel(recurrent_state.depthwise_conv1d(x, conv.weight, conv.get("bias"), init_value=float("nan")), conv(x))
        assert err <= TOL[dtype], (C, K, bias, B, L, err)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_state_rows_are_written_in_place(device, dtype):
    """The pool written through the kernel's input pointer: the very array another reference holds (a
    scatter would copy), read in the same graph after the write and by a later graph; slot -1 skipped."""
    mx.random.seed(2)
    shape = (40, 48, 128, 128) if device == "gpu" else (6, 3, 5)
    pool = mx.random.normal(shape).astype(dtype)
    mx.eval(pool)
    want = pool * 1  # a copy, made before the kernel writes the pool
    mx.eval(want)
    slots = mx.array([3, -1, 5] if device == "emulated" else [3, -1, 17, 39], mx.int32)
    values = mx.random.normal((slots.size, *shape[1:])).astype(dtype)
    keep = pool  # a second reference: a scatter would copy; the kernel must still write this very array
    written = recurrent_state.write_rows(values, slots, pool)
    last = int(slots[-1].item())
    after = mx.depends(pool[mx.array([last])], written)  # a read ordered after the write in one graph
    mx.eval(written, after)
    rows = [i for i, s in enumerate(slots.tolist()) if s >= 0]
    want[mx.array([slots[i].item() for i in rows])] = values[mx.array(rows)]
    assert written.tolist() == [0]
    assert rel(keep, want) == 0.0 and rel(after, want[last:last + 1]) == 0.0
    assert rel(pool[last] + 0, want[last]) == 0.0  # a later graph reads the written rows
