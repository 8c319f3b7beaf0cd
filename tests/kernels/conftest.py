"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest
from kernel_emulator import EmulatedKernel, have_compiler
from kernel_emulator.mma import EMU_MMA_HEADER, EMU_PREFILL_HEADER

from pagedmlx.kernels import build, fused_moe, quantized_gemm
from pagedmlx.kernels.sources import decode_attention_mma_cuda as mma_src
from pagedmlx.kernels.sources import prefill_attention_cuda as prefill_src


@pytest.fixture
def emulated_gemm(monkeypatch):
    """The quantized GEMM's kernels (kernels/quantized_gemm.py, kernels/fused_moe.py) built by the kernel emulator, its
    PTX helpers emulated; yields the monkeypatch."""
    if not have_compiler():
        pytest.skip("g++ runs the emulated kernels")
    monkeypatch.setattr(build, "make_kernel", EmulatedKernel)
    monkeypatch.setattr(mma_src, "MMA_HEADER", EMU_MMA_HEADER)
    monkeypatch.setattr(prefill_src, "PREFILL_HEADER", EMU_PREFILL_HEADER)
    kernels = (quantized_gemm._kernel, fused_moe._kernel, fused_moe._align_kernel)
    for kernel in kernels:
        kernel.cache_clear()
    yield monkeypatch
    for kernel in kernels:
        kernel.cache_clear()
