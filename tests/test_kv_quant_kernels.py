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


class WrongKernel(EmulatedKernel):
    """Compiles and runs, but its output is off by 10%."""

    def __call__(self, **call):
        return [o * 1.1 if o.dtype != mx.int32 else o for o in super().__call__(**call)]


@needs_compiler
@pytest.mark.parametrize("factory", [EmulatedKernel, WrongKernel])
def test_engine_on_quantized_pages_checks_the_kernel_then_serves_equal_tokens(monkeypatch, caplog, factory):
    """The engine believes it runs on Metal: the quantized decode kernel is checked at load; passing, it serves
    the decode rows, failing, it is switched off with one warning; tokens equal mlx-lm's QuantizedKVCache."""
    import logging

    from test_kv_quant import mlx_lm_quantized_greedy
    from utils import make_model, run_to_completion

    from pagedmlx.config import EngineConfig
    from pagedmlx.engine import LLMEngine
    from pagedmlx.runner.kernel_paths import kernel_path_lines
    from pagedmlx.sampling_params import SamplingParams

    monkeypatch.setattr(build, "gpu_backend", lambda: METAL)
    monkeypatch.delenv("PAGEDMLX_METAL_KERNELS", raising=False)
    calls = []
    monkeypatch.setattr(build, "make_kernel", lambda *a: calls.append(a[1]) or factory(*a))
    for f in (decode_attention_quant._kernels, decode_attention._kernels, decode_attention.supports):
        f.cache_clear()
    model = make_model("qwen3")  # float32, head_dim 32: 4 channels a lane, one int8 word
    with caplog.at_level(logging.WARNING, logger="pagedmlx"):
        engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64, max_model_len=256,
                                                     kv_cache_dtype="int8"))
    plan = engine.runner.kernels
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.filename == "selector.py"]
    [line] = kernel_path_lines(engine.runner)
    if factory is EmulatedKernel:
        assert plan.decode and not plan.page_write and not plan.prefill and not warnings
        assert any(label.startswith("decode int8/32") and r == "passed" for label, r in plan.checks)
        assert "decode paged decode kernel over int8 pages (group 32)" in line
    else:
        assert not plan.decode and "quantized decode kernel off" in warnings[0] and "max |difference|" in plan.reason
        assert "decode gather + SDPA over int8 pages (group 32)" in line
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 3], list(range(11, 30))]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy)
    before = len(EmulatedKernel.sources)
    done = run_to_completion(engine)
    for i, p in enumerate(prompts):
        assert done[str(i)].token_ids == mlx_lm_quantized_greedy(model, p, 6, 8, 32), i
    assert calls and (len(EmulatedKernel.sources) > before) == (factory is EmulatedKernel)  # decode rows ran it
    for f in (decode_attention_quant._kernels, decode_attention._kernels, decode_attention.supports):
        f.cache_clear()


def test_quantized_kernel_is_checked_even_on_the_trusted_gpu(monkeypatch):
    from pagedmlx.kernels import check, selector

    monkeypatch.setattr(build, "gpu_backend", lambda: CUDA)
    monkeypatch.setattr(selector, "device_name", lambda: "NVIDIA H200")
    specs, heads = [(8, 128, 128, mx.bfloat16)], [32]
    plan = selector.select_kernels(specs, heads, 16)
    plan = selector.select_kernels(specs, heads, 16, quantized=True)
    assert plan.decode and not plan.checks
    layers = [(specs[0], 32, KVQuant(8, 128))]
    monkeypatch.setattr(check, "check_decode_quantized", lambda *a: "max |difference| 1")
    off = selector.select_quantized(plan, layers, 16, "int8")
    assert not off.decode and not off.page_write and not off.prefill and "max |difference| 1" in off.reason
    monkeypatch.setattr(check, "check_decode_quantized", lambda *a: None)
    on = selector.select_quantized(plan, layers, 16, "int8")
    assert on.decode and not on.page_write and not on.prefill and on.checks[-1] == ("decode int8/128 H=32 kv=8 D=128",
                                                                                    "passed")


@pytest.mark.skipif(not __import__("nvcc_utils").have_nvcc(), reason="nvcc compiles the CUDA sources")
def test_nvcc_compiles_the_quantized_decode_kernel_without_warnings_or_spills(monkeypatch):
    """Llama-8B / Gemma-3-27B heads (bf16) and fp16 head_dim 64, int8 and int4, window and sinks, unsplit and split."""
    import os

    from nvcc_utils import RecordingCudaKernel, compile_sources

    monkeypatch.setattr(build, "make_kernel", RecordingCudaKernel)
    decode_attention_quant._kernels.cache_clear()
    decode_attention._kernels.cache_clear()
    RecordingCudaKernel.sources = []
    one = mx.zeros((1,), mx.int32)
    for dt, d, g, window, sinks in ((mx.bfloat16, 128, 4, 0, False), (mx.bfloat16, 128, 2, 1024, True),
                                    (mx.float16, 64, 8, 0, False)):
        for quant in (KVQuant(8, min(d, 128)), KVQuant(4, 64), KVQuant(4, 32)):
            pages = [QuantizedPages(*mx.quantize(mx.zeros((2, 2, 16, d), dt), quant.group_size, quant.bits), quant)
                     for _ in range(2)]
            for splits in (1, 2):
                RecordingCudaKernel.label = f"qdecode {dt} D={d} G={g} {quant} window={window} sinks={sinks} splits={splits}"
                decode_attention_quant.paged_decode_quantized(
                    mx.zeros((1, 2 * g, d), dt), *pages, mx.zeros((1, 2), mx.int32), one, 1.0, splits, one,
                    window=window, sinks=mx.zeros((2 * g,)) if sinks else None, backend=CUDA)
    sources = [(label, "#pragma nv_diag_suppress 177\n{}\n#pragma nv_diag_default 177".format(text)
                if label.endswith("_split") else text) for label, text in RecordingCudaKernel.sources]
    decode_attention_quant._kernels.cache_clear()
    decode_attention._kernels.cache_clear()
    failures, report = compile_sources(sources, os.environ.get("PAGEDMLX_NVCC_ARCH", "sm_90"))
    print(report)
    assert not failures, "\n".join(failures)
