"""nvcc compiles every CUDA kernel the engine builds, through the engine's own launch code, for the
template values it uses (model dtypes, head shapes, windows, sinks, split or not): the recurrent-state
kernels, paged prefill, paged decode (tensor cores and lanes, 16-bit and quantized pages), the page writes,
batched LoRA and the fused residual add + RMSNorm.
No GPU needed, only
nvcc (tests/nvcc_utils.py); skipped without it. PAGEDMLX_NVCC_ARCH picks the target (default sm_90,
the H200); `pytest -s` prints ptxas's registers and spills per kernel."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest
from nvcc_utils import RecordingCudaKernel, compile_sources, have_nvcc

from pagedmlx.kernels import (add_rms_norm, build, decode_attention, decode_attention_quant, fused_moe, lora,
                              page_write, prefill_attention, quantized_gemm, recurrent_state, skinny_gemm)
from pagedmlx.core.kv.cache_dtype import KVQuant
from pagedmlx.runner.kv_quant import QuantizedPages

pytestmark = pytest.mark.skipif(not have_nvcc(), reason="nvcc compiles the CUDA sources")
DTYPES = (mx.float32, mx.bfloat16, mx.float16)


def state_cases():
    """Qwen3.5 / Qwen3-Next head sizes, both gate kinds, a bias or not (as the layers call them)."""
    for dt in DTYPES:
        for dk, vec in ((128, False), (64, True), (32, False), (256, False)):
            RecordingCudaKernel.label = f"gated_delta {dt} Dk={dk} vec_g={vec}"
            q = mx.zeros((1, 1, 16, dk), dt)
            recurrent_state.gated_delta(q, q, mx.zeros((1, 1, 48, 128), dt),
                                        mx.zeros((1, 1, 48, dk) if vec else (1, 1, 48)),
                                        mx.zeros((1, 1, 48), dt), mx.zeros((1, 48, 128, dk)))
        for bias in (True, False):
            RecordingCudaKernel.label = f"depthwise_conv {dt} bias={bias}"
            recurrent_state.depthwise_conv1d(mx.zeros((1, 5, 96), dt), mx.zeros((96, 4, 1), dt),
                                             mx.zeros((96,), dt) if bias else None)
        RecordingCudaKernel.label = f"write_rows {dt}"
        recurrent_state.write_rows(mx.zeros((1, 48, 128, 128), dt), mx.zeros((1,), mx.int32),
                                   mx.zeros((2, 48, 128, 128), dt))


def attention_cases():
    """Prefill for each head_dim it takes, 1..8 query heads per KV head, window and sinks, unsplit
    and split (with the merge); decode on tensor cores and on lanes, the same variants; the page write."""
    one = mx.zeros((1,), mx.int32)
    for dt in (mx.bfloat16, mx.float16):
        for d in prefill_attention.PREFILL_HEAD_DIMS:
            for g, window, sinks in ((1, 0, False), (4, 0, False), (7, 0, False), (8, 4096, True)):
                for splits in (1, 2):
                    RecordingCudaKernel.label = (f"prefill {dt} D={d} G={g} window={window} sinks={sinks} "
                                                 f"splits={splits}")
                    pages = mx.zeros((2, 1, 16, d), dt)
                    prefill_attention.paged_prefill(mx.zeros((16, g, d), dt), pages, pages, mx.zeros((1, 2), mx.int32),
                                                    mx.zeros((1, 4), mx.int32), mx.zeros((1, 2), mx.int32), 1.0, splits,
                                                    one, window=window, sinks=mx.zeros((g,)) if sinks else None)
    for dt, d, g, window, sinks in ((mx.bfloat16, 128, 4, 0, False), (mx.bfloat16, 64, 8, 0, False),
                                    (mx.bfloat16, 256, 2, 1024, True), (mx.float16, 128, 7, 100, True),
                                    (mx.float32, 128, 4, 0, False), (mx.float32, 64, 7, 4096, True)):
        for mma in (1, 0) if dt != mx.float32 else (0,):
            for splits in (1, 2):
                RecordingCudaKernel.label = (f"decode {dt} D={d} G={g} window={window} sinks={sinks} mma={mma} "
                                             f"splits={splits}")
                pages = mx.zeros((2, 2, 16, d), dt)
                settings = decode_attention.SETTINGS["cuda"].__class__(**{
                    **decode_attention.SETTINGS["cuda"].__dict__, "mma": mma})
                decode_attention.paged_decode(mx.zeros((1, 2 * g, d), dt), pages, pages, mx.zeros((1, 2), mx.int32),
                                              one, 1.0, splits, one, window=window,
                                              sinks=mx.zeros((2 * g,)) if sinks else None, settings=settings,
                                              backend="cuda")
    for dt in DTYPES:
        RecordingCudaKernel.label = f"page write {dt}"
        pages = mx.zeros((2, 2, 16, 128), dt)
        page_write.reshape_and_cache(mx.zeros((3, 2, 1, 128), dt), mx.zeros((3, 2, 1, 128), dt), pages, pages,
                                     mx.zeros((3,), mx.int32), backend="cuda")
        for in_dims, out_dims, rank in ((4096, 14336, 16), (14336, 4096, 64)):  # Llama-8B's gate / down
            RecordingCudaKernel.label = f"lora {dt} {in_dims}->{out_dims} R={rank}"
            lora.add_lora(mx.zeros((3, in_dims), dt), mx.zeros((3, out_dims), dt), mx.zeros((5, rank, in_dims), dt),
                          mx.zeros((5, rank, out_dims), dt), mx.zeros((3,), mx.int32), mx.zeros((5,)), backend="cuda")
        for d in (576, 4096, 8192):  # SmolLM2's, Llama-8B's, Llama-70B's widths
            RecordingCudaKernel.label = f"add_rms_norm {dt} D={d}"
            add_rms_norm.add_rms_norm(mx.zeros((3, d), dt), mx.zeros((3, d), dt), mx.zeros((d,), dt), 1e-5, "cuda")
        if dt in skinny_gemm.DTYPES:
            for rows in (2, 8):  # Llama-8B's two widths; 1, 2 and 4 columns a SIMD group (rows_per_warp), K split
                for k in (4096, 14336):  # 1, 2 and 4 ways (k_split)
                    for n in (1024, 4096, 8192, 28672, 32768):
                        RecordingCudaKernel.label = f"skinny_gemm {dt} M={rows} K={k} N={n}"
                        skinny_gemm.skinny_gemm(mx.zeros((rows, k), dt), mx.zeros((n, k), dt), "cuda", mma=False)
            for n, k in ((1536, 576), (576, 1536)):  # SmolLM2's widths: 576 is no whole number of 256-value steps
                RecordingCudaKernel.label = f"skinny_gemm {dt} M=5 K={k} N={n}"
                skinny_gemm.skinny_gemm(mx.zeros((5, k), dt), mx.zeros((n, k), dt), "cuda", mma=False)
        if dt in skinny_gemm.MMA_DTYPES:
            for rows, k, n, warps, unroll in ((2, 4096, 6144, 8, 2), (5, 14336, 4096, 8, 2), (8, 4096, 1000, 8, 2),
                                              (8, 4096, 4096, 4, 4), (3, 4096, 4096, 16, 1)):
                RecordingCudaKernel.label = f"skinny_gemm mma {dt} M={rows} K={k} N={n} WARPS={warps} UNROLL={unroll}"
                skinny_gemm.skinny_gemm(mx.zeros((rows, k), dt), mx.zeros((n, k), dt), "cuda", mma=True, warps=warps,
                                        unroll=unroll)
        RecordingCudaKernel.label = f"lora {dt} siblings q/k/v 4096->4096/1024/1024 R=16"
        outs = (4096, 1024, 1024)
        lora.add_lora_siblings(mx.zeros((3, 4096), dt), [mx.zeros((3, o), dt) for o in outs],
                               [mx.zeros((5, 16, 4096), dt) for _ in outs], [mx.zeros((5, 16, o), dt) for o in outs],
                               mx.zeros((3,), mx.int32), mx.zeros((5,)), backend="cuda")


def quantized_cases():
    """Quantized weights' GEMM (formats, row tiles, K split); quantized pages: decode on tensor cores (every
    head_dim it takes, int8 / int4 at each group size, window and sinks, unsplit and split) and on lanes; prefill
    (both head dims, int8 and int4); the page writes."""
    one = mx.zeros((1,), mx.int32)
    lanes = decode_attention.SETTINGS["cuda"].__class__(**{**decode_attention.SETTINGS["cuda"].__dict__, "mma": 0})
    for dt, d, g, window, sinks in ((mx.bfloat16, 128, 4, 0, False), (mx.bfloat16, 128, 7, 100, True),
                                    (mx.bfloat16, 256, 2, 1024, True), (mx.float16, 64, 8, 0, False)):
        for quant in (KVQuant(8, min(d, 128)), KVQuant(8, 64), KVQuant(4, 64), KVQuant(4, 32)):
            pages = [QuantizedPages(*mx.quantize(mx.zeros((2, 2, 16, d), dt), quant.group_size, quant.bits), quant)
                     for _ in range(2)]
            for settings in (None, lanes):
                assert decode_attention_quant.uses_tensor_cores(d, g, dt, quant, "cuda", settings) == (settings is None)
                for splits in (1, 2):
                    RecordingCudaKernel.label = (f"decode {dt} D={d} G={g} {quant} window={window} sinks={sinks} "
                                                 f"mma={settings is None} splits={splits}")
                    decode_attention_quant.paged_decode_quantized(
                        mx.zeros((1, 2 * g, d), dt), *pages, mx.zeros((1, 2), mx.int32), one, 1.0, splits, one,
                        window=window, sinks=mx.zeros((2 * g,)) if sinks else None, settings=settings, backend="cuda")
    os.environ["PAGEDMLX_QUANT_PREFETCH"] = "0"  # int8's scale-after and int4's tiles loaded where used
    decode_attention_quant._launch.cache_clear()
    try:
        for quant in (KVQuant(8, 128), KVQuant(4, 64)):
            pages = [QuantizedPages(*mx.quantize(mx.zeros((2, 2, 16, 128), mx.bfloat16), quant.group_size, quant.bits),
                                    quant) for _ in range(2)]
            RecordingCudaKernel.label = f"decode bfloat16 D=128 G=4 {quant} no prefetch"
            decode_attention_quant.paged_decode_quantized(mx.zeros((1, 8, 128), mx.bfloat16), *pages,
                                                          mx.zeros((1, 2), mx.int32), one, 1.0, 1, one, backend="cuda")
    finally:
        del os.environ["PAGEDMLX_QUANT_PREFETCH"]
        decode_attention_quant._launch.cache_clear()
    for dt, d, g, window, sinks in ((mx.bfloat16, 128, 4, 0, False), (mx.float16, 64, 8, 4096, True)):
        for quant in (KVQuant(8, min(d, 128)), KVQuant(4, 32)):
            pages = [QuantizedPages(*mx.quantize(mx.zeros((2, 1, 16, d), dt), quant.group_size, quant.bits), quant)
                     for _ in range(2)]
            for splits in (1, 2):
                RecordingCudaKernel.label = f"prefill {dt} D={d} G={g} {quant} window={window} splits={splits}"
                prefill_attention.paged_prefill(mx.zeros((16, g, d), dt), *pages, mx.zeros((1, 2), mx.int32),
                                                mx.zeros((1, 4), mx.int32), mx.zeros((1, 2), mx.int32), 1.0, splits,
                                                one, window=window, sinks=mx.zeros((g,)) if sinks else None)
    for dt, bits, group_size in ((mx.bfloat16, 4, 64), (mx.float16, 8, 32), (mx.bfloat16, 4, 128)):
        odd_k = 1024 + max(group_size, 64)  # past whole 128-value chunks
        for rows, n, k in ((2, 6144, 4096), (64, 4096, 14336), (256, 28672, 4096), (9, 1000, odd_k)):
            RecordingCudaKernel.label = f"quantized_gemm {dt} {bits}-bit g{group_size} M={rows} K={k} N={n}"
            w, scales, biases = mx.quantize(mx.zeros((n, k), dt), group_size=group_size, bits=bits)
            quantized_gemm.quantized_gemm(mx.zeros((rows, k), dt), w, scales, biases, bits, group_size)
        for tokens, n, k in ((1, 512, 2048), (64, 2048, 512)):  # a one-token step (2 warps), 64 tokens (4)
            RecordingCudaKernel.label = f"fused_moe {dt} {bits}-bit g{group_size} T={tokens} K={k} N={n}"
            w, scales, biases = mx.quantize(mx.zeros((16, n, k), dt), group_size=group_size, bits=bits)
            b = fused_moe.moe_align(mx.zeros((tokens, 8), mx.int32) + mx.arange(8), 16)
            fused_moe.grouped_quantized_gemm(mx.zeros((tokens, k), dt), w, scales, biases, b.token_rows, b.ids,
                                             b.experts, tokens * 8, bits, group_size)
    for dt in (mx.bfloat16, mx.float16, mx.float32):
        for quant in (KVQuant(8, 128), KVQuant(4, 32)):
            RecordingCudaKernel.label = f"page write {dt} {quant}"
            new = [mx.quantize(mx.zeros((3, 2, 128), dt), quant.group_size, quant.bits) for _ in range(2)]
            pages = [mx.quantize(mx.zeros((2, 2, 16, 128), dt), quant.group_size, quant.bits) for _ in range(2)]
            page_write.reshape_and_cache_quantized(*new, *pages, mx.zeros((3,), mx.int32), backend="cuda")
            RecordingCudaKernel.label = f"quantizing page write {dt} {quant}"
            rows = mx.zeros((3, 2, 1, 128), dt)
            page_write.reshape_and_cache_quantizing(rows, rows, *pages, mx.zeros((3,), mx.int32), quant, backend="cuda")


@pytest.fixture
def recorded(monkeypatch):
    monkeypatch.setattr(build, "make_kernel", RecordingCudaKernel)
    cached = (decode_attention._kernels, decode_attention_quant._kernels, page_write._write_kernel,
              page_write._quant_write_kernel, page_write._quantizing_write_kernel, prefill_attention._prefill_kernels,
              recurrent_state._kernel, lora._kernel, add_rms_norm._kernel, skinny_gemm._kernel,
              quantized_gemm._kernel, fused_moe._kernel, fused_moe._align_kernel)
    for fn in cached:
        fn.cache_clear()
    RecordingCudaKernel.sources = []
    yield RecordingCudaKernel.sources
    for fn in cached:
        fn.cache_clear()


# The decode kernels' split pass takes the SINKS flag with the others but leaves the sink term to the
# merge: an unused constant (nvcc's warning 177), harmless; every other warning fails.
UNUSED_SINKS = "#pragma nv_diag_suppress 177\n{}\n#pragma nv_diag_default 177"


@pytest.mark.slow
@pytest.mark.parametrize("cases", [state_cases, attention_cases, quantized_cases])
def test_every_cuda_kernel_compiles_without_warnings_or_spills(recorded, cases):
    cases()
    assert len({text for _, text in recorded}) > 10
    sources = [(label, UNUSED_SINKS.format(text) if label.startswith("decode") and label.endswith("_split")
                else text) for label, text in recorded]
    failures, report = compile_sources(sources, os.environ.get("PAGEDMLX_NVCC_ARCH", "sm_90"))
    print(report)
    assert not failures, "\n".join(failures)
