"""The paged prefill kernel on tensor cores, on the CPU: its CUDA source with the PTX helpers emulated
(tests/kernel_emulator/mma.py: ldmatrix, mma.sync with all 16 rows, cp.async as plain copies). The 16-bit
kernel (run on the H200 by the GPU suite) matching the reference shows the emulation right; the kernel over
quantized pages (kernels/sources/prefill_attention_quant_cuda.py) is then held to the same float64 reference
over the pages' dequantized values: segments after prefixes, tile, page and split boundaries, windows and
sinks. What only the GPU shows: the real PTX, nvcc's code (tests/test_cuda_sources.py compiles it), speed."""

from __future__ import annotations

import mlx.core as mx
import pytest
from kernel_emulator import EmulatedKernel, clear_kernel_caches, have_compiler
from kernel_emulator.mma import EMU_MMA_HEADER, EMU_PREFILL_HEADER, WAIT_ALL
from utils import QUANTIZED_GAP, assert_greedy
from kernel_cache_utils import fake_compile_workers

from pagedmlx.kernels import build, check, prefill_attention
from pagedmlx.kernels.sources import decode_attention_mma_cuda as mma_src
from pagedmlx.kernels.sources import prefill_attention_cuda as prefill_src
from pagedmlx.kernels.sources import prefill_attention_quant_cuda as quant_src
from pagedmlx.core.kv.cache_dtype import KVQuant

pytestmark = pytest.mark.skipif(not have_compiler(), reason="g++ runs the emulated kernels")


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(build, "make_kernel", EmulatedKernel)
    monkeypatch.setattr(mma_src, "MMA_HEADER", EMU_MMA_HEADER)
    monkeypatch.setattr(prefill_src, "PREFILL_HEADER", EMU_PREFILL_HEADER)
    monkeypatch.setattr(prefill_src, "ACCUMULATE", prefill_src.ACCUMULATE.replace(WAIT_ALL, "cp_async_wait_all();"))
    monkeypatch.setattr(mma_src, "ACCUMULATE_MMA", mma_src.ACCUMULATE_MMA.replace(WAIT_ALL, "cp_async_wait_all();"))
    prefill_attention._prefill_kernels.cache_clear()
    yield monkeypatch
    prefill_attention._prefill_kernels.cache_clear()


@pytest.mark.parametrize("dtype,h,n_kv,d,window,sinks", [(mx.bfloat16, 4, 2, 64, None, False),
                                                         (mx.float16, 2, 1, 128, 24, True)])
def test_the_16_bit_kernel_emulated_matches_the_reference(emulated, dtype, h, n_kv, d, window, sinks):
    assert check.check_prefill(h, n_kv, d, dtype, 8, window, sinks) is None


@pytest.mark.parametrize("dtype,h,n_kv,d,quant,window,sinks", [
    (mx.bfloat16, 4, 2, 64, KVQuant(8, 64), None, False),
    (mx.bfloat16, 2, 1, 128, KVQuant(4, 64), 24, True),
    (mx.float16, 4, 2, 64, KVQuant(4, 32), None, True),
    (mx.float16, 2, 2, 128, KVQuant(8, 128), 24, False)])
def test_the_quantized_pages_kernel_matches_the_reference_over_dequantized_pages(emulated, dtype, h, n_kv, d, quant,
                                                                                  window, sinks):
    assert prefill_attention.quant_prefill_refusal(d, d, h, n_kv, dtype, quant) is None
    assert check.check_prefill(h, n_kv, d, dtype, 8, window, sinks, quant=quant) is None


def test_a_kernel_that_reads_another_group_fails_the_check(emulated):
    """Each piece's scale and bias taken from the row's first group: int4 pages in groups of 32 (four a head
    of 128) fail; the check can fail."""
    emulated.setattr(quant_src, "_QLOAD", quant_src._QLOAD.replace("piece * (128 / QBITS) / QGROUP", "0"))
    emulated.setattr(quant_src, "REPLACEMENTS",
                     [quant_src.REPLACEMENTS[0], (prefill_src.STAGE_LOAD, quant_src._QLOAD, 1)])
    err = check.check_prefill(2, 1, 128, mx.bfloat16, 8, quant=KVQuant(4, 32))
    assert err is not None and "max |difference|" in err


def test_a_16_bit_loop_the_replacements_do_not_fit_is_refused():
    with pytest.raises(ValueError, match="must follow it"):
        quant_src.quantized_prefill(prefill_src.ACCUMULATE.replace("cp_async_commit();", "cp_async_commit(); "))


def _quantized_engine(monkeypatch, names: list, wrap=lambda kernel, *args: kernel):
    """A bf16 llama on int8 pages in an engine that believes it runs on CUDA, its kernels emulated (each through
    `wrap`)."""
    from pagedmlx.config import EngineConfig
    from pagedmlx.engine.llm_engine import LLMEngine
    from pagedmlx.kernels import selector
    from pagedmlx.loaders.random_model import build_model

    monkeypatch.setattr(build, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(selector, "device_name", lambda: "emulated")
    monkeypatch.delenv("PAGEDMLX_CUDA_KERNELS", raising=False)
    monkeypatch.setattr(build, "make_kernel", lambda *a: names.append(a[1]) or wrap(EmulatedKernel(*a), *a))
    clear_kernel_caches()
    model = build_model(dict(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                             num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=512))
    model.set_dtype(mx.bfloat16)
    return model, LLMEngine(model, None, EngineConfig(block_size=8, num_blocks=64, max_model_len=256,
                                                      kv_cache_dtype="int8", compile_decode=False))


def test_a_cuda_start_compiles_its_checks_variants_at_once_and_then_runs_them(emulated, monkeypatch, tmp_path):
    """The engine's whole start on "CUDA", its kernels emulated and kept by the disk cache (NVRTC and its worker
    processes stand-ins): the dry pass names the quantized pages' kernels' variants, the workers compile them
    before any check runs, the checks and the model check then run the kernels themselves (none compiled again as
    it is launched), and a request's tokens equal mlx-lm's QuantizedKVCache alone."""
    from pagedmlx.kernels import disk_cache
    from test_kv_quant import mlx_lm_quantized

    fake, calls = fake_compile_workers(monkeypatch, tmp_path)

    def cached(kernel, backend, name, inputs, outputs, source, header, *rest):
        return disk_cache.CachedCudaKernel(kernel, name, inputs, outputs, source, header)

    model, engine = _quantized_engine(monkeypatch, [], wrap=cached)
    given = [names for names, _, _ in calls]
    try:
        plan = engine.runner.kernels
        # (The emulator's copy of the tensor-core decode source fails its own splice check: the decode kernel and
        # page write are off here, as in the test above; the prefill kernel passes and runs.)
        assert plan.prefill and ("prefill int8/64 H=2 kv=1 D=64", "passed") in plan.checks, plan.checks
        # The first workers' batch: the paged kernels' checks (the skinny GEMM's check prebuilds its own after).
        assert any("paged_prefill_quant" in name for name in given[0]), given
        assert sorted(fake.modules[:len(given[0])]) == given[0]  # compiled before any check ran
        worked = [name for batch in given for name in batch]
        assert len(fake.modules) >= len(worked) and len(set(fake.modules)) == len(fake.modules)  # none built twice
        prompt = list(range(1, 40))
        out = _greedy_request(engine, prompt, 4)
        assert out.finish_reason == "length"
        assert_greedy(out.token_ids, prompt, 4, mlx_lm_quantized(model, 8, 64), gap=QUANTIZED_GAP)
    finally:
        clear_kernel_caches()


def _greedy_request(engine, prompt: list[int], max_tokens: int):
    from pagedmlx.sampling_params import SamplingParams
    from utils import run_to_completion

    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return run_to_completion(engine)["a"]


def test_an_engine_on_quantized_pages_checks_the_prefill_kernel_and_runs_it(emulated, monkeypatch):
    """The engine believes it runs on CUDA: select_quantized checks the prefill kernel over int8 pages (and the
    decode kernel and page writes), the runner's load-time check (a busy schedule against mlx-lm's caches)
    passes with it, its startup line says so, and a step with prefill rows runs it: the request's tokens
    equal mlx-lm's QuantizedKVCache alone (the attention path once skipped the kernel for quantized pages
    and failed every such step)."""
    from pagedmlx.runner.kernel_paths import kernel_path_lines
    from test_kv_quant import mlx_lm_quantized

    names = []
    model, engine = _quantized_engine(monkeypatch, names)
    plan = engine.runner.kernels
    assert plan.prefill and engine.runner.prefill_heads == [(1, 2)], plan.checks
    assert ("prefill int8/64 H=2 kv=1 D=64", "passed") in plan.checks
    assert "prefill paged prefill kernel over int8 pages (group 64)" in kernel_path_lines(engine.runner)[0]
    assert "pagedmlx_paged_prefill_quant" in names
    before = len(EmulatedKernel.sources)
    prompt = list(range(1, 40))
    out = _greedy_request(engine, prompt, 4)
    assert any("store_piece<T, D, QBITS>(kv[stage][0]" in text for text in EmulatedKernel.sources[before:])
    assert out.finish_reason == "length"  # the step ran, not failed
    assert_greedy(out.token_ids, prompt, 4, mlx_lm_quantized(model, 8, 64), gap=QUANTIZED_GAP)
    clear_kernel_caches()


def test_an_engine_on_int8_pages_decodes_through_the_scale_after_kernel(emulated, monkeypatch):
    """The same engine with the tensor-core decode kernel over int8 pages emulated as well (one group a row of
    64 channels: the scale and bias apply after the products, fp16 products in a bf16 model): it passes the
    load-time checks, its decode steps run it, and the request's tokens equal mlx-lm's QuantizedKVCache alone."""
    from pagedmlx.runner.kernel_paths import kernel_path_lines
    from test_kv_quant import mlx_lm_quantized

    from pagedmlx.kernels.sources import decode_attention_quant_mma_cuda as qmma_src

    # the quantized loop drops the 16-bit loop's last wait, which the fixture made the emulator's own call
    swapped = [("    cp_async_wait_all();\n", new, n) if WAIT_ALL in old else (old, new, n)
               for old, new, n in qmma_src.REPLACEMENTS]
    monkeypatch.setattr(qmma_src, "REPLACEMENTS", swapped)
    model, engine = _quantized_engine(monkeypatch, [])
    assert engine.runner.kernels.decode, engine.runner.kernels.checks
    assert ("decode paged decode kernel over int8 pages (group 64) on tensor cores"
            in kernel_path_lines(engine.runner)[0])
    before = len(EmulatedKernel.sources)
    prompt = list(range(1, 40))
    out = _greedy_request(engine, prompt, 8)
    assert any("SCALE_AFTER = 1" in text for text in EmulatedKernel.sources[before:])
    assert_greedy(out.token_ids, prompt, 8, mlx_lm_quantized(model, 8, 64), gap=QUANTIZED_GAP)
    clear_kernel_caches()


def test_a_prefill_kernel_the_model_check_rejects_is_switched_off_when_it_runs_alone(emulated, monkeypatch, caplog):
    """The quantized decode kernel and page write fail their checks, so the prefill kernel is the only kernel
    left; it passes its own check, but the model's paged forward through it disagrees with mlx-lm (here: its
    output shifted on the runner's path only). The runner switches it off and serves through the portable
    path, with mlx-lm's tokens, instead of refusing the model (KernelPlan.enabled once left it out)."""
    import logging
    import types

    from pagedmlx.kernels import check, prefill_attention
    from pagedmlx.runner import attention
    from test_kv_quant import mlx_lm_quantized

    monkeypatch.setattr(check, "check_decode_quantized", lambda *a, **k: "disagrees (forced)")
    monkeypatch.setattr(check, "check_page_write_quantized", lambda *a, **k: "disagrees (forced)")
    wrong = types.SimpleNamespace(paged_prefill=lambda *a, **k: prefill_attention.paged_prefill(*a, **k) + 1.0)
    monkeypatch.setattr(attention, "prefill_attention", wrong)
    with caplog.at_level(logging.WARNING, logger="pagedmlx"):
        model, engine = _quantized_engine(monkeypatch, [])
    plan = engine.runner.kernels
    assert not plan.prefill and not plan.decode and "disagrees with mlx-lm" in plan.reason
    assert any("kernels off" in r.getMessage() and "disagrees with mlx-lm" in r.getMessage() for r in caplog.records)
    prompt = list(range(1, 40))
    assert_greedy(_greedy_request(engine, prompt, 4).token_ids, prompt, 4, mlx_lm_quantized(model, 8, 64),
                  gap=QUANTIZED_GAP)
    clear_kernel_caches()
