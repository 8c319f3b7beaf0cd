"""The quantized decode kernel (kernels/decode_attention_quant.py) without a GPU: its CUDA and Metal
sources run on the CPU (tests/kernel_emulator) and match the portable path over the same quantized
pages (gather, dequantize, SDPA), windows, sinks and splits included; its text is the 16-bit loop's
with every replacement applied. The tensor-core kernel's PTX does not run here: its text, selection and
(tests/test_mma_fragments.py) its tile addressing are tested, and nvcc compiles it (tests/test_cuda_sources.py).
The quantized page write runs in the emulator against a scatter, and in an engine against mlx-lm."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from utils import fast_first
from kernel_emulator import EmulatedKernel, clear_kernel_caches, have_compiler

from pagedmlx.kernels import build, decode_attention, decode_attention_quant
from pagedmlx.kernels.dialect import CUDA, METAL, foreign_names, leftover_tokens
from pagedmlx.kernels.sources import decode_attention as src
from pagedmlx.kernels.sources import decode_attention_mma_cuda as mma_src
from pagedmlx.kernels.sources import decode_attention_quant as qsrc
from pagedmlx.kernels.sources import decode_attention_quant_mma_cuda as qmma_src
from pagedmlx.core.kv.cache_dtype import KVQuant
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
    with pytest.raises(ValueError, match="must follow it"):
        qmma_src.quantized_accumulate_mma(mma_src.ACCUMULATE_MMA.replace("cp_async_wait_1();", "cp_async_wait_0();"))


def test_tensor_core_source_loads_quantized_tiles_and_no_16_bit_ones():
    body, header = decode_attention_quant.quant_decode_sources(CUDA, mma=True)["single"]
    assert "store_piece<T, D, QBITS, AFTER>" in body and "fetch(tile + STEP)" in body and "mma16816_top(" in body
    assert "cp_async16(" not in body and "cp.async.wait_all" not in body and "tiles[warp][stage]" not in body
    assert not leftover_tokens(header + body)
    with pytest.raises(ValueError, match="CUDA only"):
        decode_attention_quant.quant_decode_sources(METAL, mma=True)


LANES = decode_attention.SETTINGS[CUDA].__class__(**{**decode_attention.SETTINGS[CUDA].__dict__, "mma": 0})


@pytest.mark.parametrize("shape", [(32, 8, 128), (32, 16, 128), (28, 4, 128), (8, 1, 64), (4, 2, 256)])
@pytest.mark.parametrize("quant", [KVQuant(8, 128), KVQuant(8, 64), KVQuant(4, 64), KVQuant(4, 32)])
def test_cuda_picks_tensor_cores_where_the_16_bit_kernel_does(shape, quant):
    h, n_kv, d = shape
    if d % quant.group_size:
        return
    for dt in (mx.bfloat16, mx.float16):
        assert decode_attention_quant.uses_tensor_cores(d, h // n_kv, dt, quant, CUDA)
        assert decode_attention.uses_tensor_cores(d, h // n_kv, dt, CUDA)
        assert decode_attention_quant.refusal(d, d, h, n_kv, dt, quant, CUDA) is None
        assert not decode_attention_quant.uses_tensor_cores(d, h // n_kv, dt, quant, METAL)
        assert not decode_attention_quant.uses_tensor_cores(d, h // n_kv, dt, quant, CUDA, LANES)
    assert not decode_attention_quant.uses_tensor_cores(d, h // n_kv, mx.float32, quant, CUDA)


def test_tensor_cores_refuse_what_the_16_bit_kernel_refuses():
    q = KVQuant(8, 32)
    assert not decode_attention_quant.uses_tensor_cores(96, 4, mx.bfloat16, q, CUDA)  # head_dim 96
    assert not decode_attention_quant.uses_tensor_cores(128, 16, mx.bfloat16, q, CUDA)  # 16 query heads a kv head
    assert not decode_attention_quant.supports_mma(128, 4, mx.bfloat16, KVQuant(2, 32))


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
@pytest.mark.parametrize("dtype,D,H,KV,lens,window,bits,group", fast_first(1, CASES))
def test_emulated_quantized_kernel_matches_the_gather_path(emulated, backend, dtype, D, H, KV, lens, window,
                                                           bits, group):
    quant = KVQuant(bits, group)
    assert decode_attention_quant.refusal(D, D, H, KV, dtype, quant, backend) is None
    assert not decode_attention_quant.uses_tensor_cores(D, H // KV, dtype, quant, backend, LANES)
    rng = np.random.default_rng(3)
    q, k, v, table, seq_lens, sinks = quantized_case(rng, dtype, D, H, KV, lens, quant)
    tol = {mx.float16: 5e-3, mx.bfloat16: 3e-2}[dtype]
    for w, with_sinks in [(None, False), (window, True)]:
        s = sinks if with_sinks else None
        want = gather_decode(q, k, v, table, D ** -0.5, length_mask(seq_lens, table.shape[1] * 16, w), s)
        span = min(max(lens), w or max(lens))
        for splits in (1, 3):
            tokens = -(-span // splits)
            got = decode_attention_quant.paged_decode_quantized(  # CUDA: the lanes kernel (no PTX here)
                q, k, v, table, seq_lens, D ** -0.5, -(-span // tokens), mx.array([tokens], mx.int32), window=w,
                sinks=s, init_value=float("nan"), settings=LANES if backend == CUDA else None, backend=backend)
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

    from test_kv_quant import mlx_lm_quantized
    from utils import QUANTIZED_GAP, assert_greedy, make_model, run_to_completion

    from pagedmlx.config import EngineConfig
    from pagedmlx.engine.llm_engine import LLMEngine
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
        assert_greedy(done[str(i)].token_ids, p, 6, mlx_lm_quantized(model, 8, 32), i, QUANTIZED_GAP)
    assert calls and (len(EmulatedKernel.sources) > before) == (factory is EmulatedKernel)  # decode rows ran it
    for f in (decode_attention_quant._kernels, decode_attention._kernels, decode_attention.supports):
        f.cache_clear()


def test_quantized_kernels_are_checked_even_on_the_trusted_gpu(monkeypatch, caplog):
    """On the H200 (16-bit kernels trusted) the quantized decode kernel, the quantized page write, the write
    that quantizes itself and the prefill kernel over quantized pages are still checked at load; each failure
    switches off only its own kernel, with one warning (the quantizing write's: mx.quantize runs before the
    in-place copy; the prefill kernel's: prefill rows gather and dequantize)."""
    import logging

    from pagedmlx.kernels import check, selector

    monkeypatch.setattr(build, "gpu_backend", lambda: CUDA)
    monkeypatch.setattr(selector, "device_name", lambda: "NVIDIA H200")
    specs, heads = [(8, 128, 128, mx.bfloat16)], [32]
    plan = selector.select_kernels(specs, heads, 16, quantized=True)
    assert plan.decode and plan.page_write and not plan.checks
    layers = [(specs[0], 32, KVQuant(8, 128))]
    for decode_err, write_err, quant_err, prefill_err in (
            (None, None, None, None), ("max |difference| 1", None, None, None), (None, "the pages differ", None, None),
            (None, None, "the scales differ", None), ("max |difference| 1", "the pages differ", None, None),
            (None, None, None, "max |difference| 2")):
        monkeypatch.setattr(check, "check_decode_quantized", lambda *a, e=decode_err: e)
        monkeypatch.setattr(check, "check_prefill", lambda *a, e=prefill_err, quant=None: e)
        monkeypatch.setattr(check, "check_page_write_quantized",
                            lambda *a, e=write_err, qe=quant_err, quantizing=False: qe if quantizing else e)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pagedmlx"):
            got = selector.select_quantized(plan, layers, 16, "int8")
        assert got.decode == (decode_err is None) and got.page_write == (write_err is None)
        assert got.quantize_in_write == (write_err is None and quant_err is None)
        assert got.prefill == (prefill_err is None) and (got.prefill_reason is None) == (prefill_err is None)
        assert ("prefill int8/128 H=32 kv=8 D=128", "passed" if prefill_err is None else f"failed: {prefill_err}") \
            in got.checks
        assert len(caplog.records) == sum(e is not None for e in (decode_err, write_err, quant_err, prefill_err))
        assert ("page write int8/128 kv=8 D=128",
                "passed" if write_err is None else f"failed: {write_err}") in got.checks
        assert (got.page_write_reason is None) == (write_err is None)
        if write_err is None:
            assert ("quantizing page write int8/128 kv=8 D=128",
                    "passed" if quant_err is None else f"failed: {quant_err}") in got.checks
        assert (got.quantizing_reason is None) == (quant_err is None)
        if quant_err:
            assert "mx.quantize runs before the page write" in caplog.records[-1].getMessage()
        if prefill_err:
            assert "prefill rows gather and dequantize" in caplog.records[0].getMessage()
        if decode_err is None:
            assert got.checks[-1] == ("decode int8/128 H=32 kv=8 D=128", "passed")
        else:
            assert decode_err in got.reason


class SkippedWrite(EmulatedKernel):
    """The quantized page write does nothing (returns `written` without running)."""

    def __call__(self, **call):
        if "reshape_and_cache_quant" in self.name:
            return [mx.zeros((4,), mx.int32)]
        return super().__call__(**call)


@needs_compiler
@pytest.mark.parametrize("backend,dtype,d,quant", [(METAL, mx.bfloat16, 128, KVQuant(8, 128)),
                                                   (METAL, mx.float16, 64, KVQuant(4, 32)),
                                                   (CUDA, mx.float16, 32, KVQuant(8, 32)),
                                                   (CUDA, mx.float32, 32, KVQuant(4, 32))])
def test_emulated_quantized_page_write_passes_its_check_and_a_skipped_one_fails(monkeypatch, backend, dtype, d, quant):
    """check.check_page_write_quantized: the parts land bit for bit where a scatter puts them (a negative slot
    skipped), and a read in the same graph sees them; a write that does not happen fails it."""
    from pagedmlx.kernels import check, page_write

    for factory, ok in ((EmulatedKernel, True), (SkippedWrite, False)):
        monkeypatch.setattr(build, "make_kernel", factory)
        for f in (decode_attention_quant._kernels, decode_attention._kernels, page_write._quant_write_kernel):
            f.cache_clear()
        err = check.check_page_write_quantized(backend, 2, 2, d, dtype, quant, 8)
        assert (err is None) == ok, err
        if not ok:
            assert "differ from a scatter" in err
    for f in (decode_attention_quant._kernels, decode_attention._kernels, page_write._quant_write_kernel):
        f.cache_clear()


@needs_compiler
@pytest.mark.parametrize("kv_cache_dtype,bits", [("int8", 8), ("int4", 4)])
@pytest.mark.parametrize("gpu_quantizer", [True, False])
def test_engine_writes_quantized_pages_in_place_and_serves_equal_tokens(monkeypatch, caplog, kv_cache_dtype, bits,
                                                                        gpu_quantizer):
    """Pages in place (as on CUDA; here Metal's sources in the emulator, steps overlapping as async scheduling
    does): the quantized page writes are checked at load and one runs every step, every reader waits on its
    `written`; each request's tokens equal mlx-lm's QuantizedKVCache for its prompt alone.
    gpu_quantizer: the load-time check's mx.quantize computes as MLX's GPU one does (tests/kv_quant_reference.py),
    so the write that quantizes the rows itself passes it and runs. Otherwise it meets this CPU's mx.quantize,
    which differs (rounding, a negative group's max): it is switched off with a warning, mx.quantize runs first."""
    import logging

    from kv_quant_reference import gpu_quantize
    from test_kv_quant import mlx_lm_quantized
    from utils import QUANTIZED_GAP, assert_greedy, make_model, run_to_completion

    from pagedmlx.config import EngineConfig
    from pagedmlx.engine.llm_engine import LLMEngine
    from pagedmlx.kernels import check, selector
    from pagedmlx.runner.kernel_paths import kernel_path_lines
    from pagedmlx.sampling_params import SamplingParams

    monkeypatch.setattr(build, "gpu_backend", lambda: METAL)
    monkeypatch.setattr(selector, "PAGES_IN_PLACE", {METAL: True})
    monkeypatch.delenv("PAGEDMLX_METAL_KERNELS", raising=False)
    if gpu_quantizer:
        checked = check.check_page_write_quantized
        monkeypatch.setattr(check, "check_page_write_quantized", lambda *a, **k: checked(
            *a, **k, quantize=lambda x: gpu_quantize(x, a[5].group_size, a[5].bits)))
    names = []
    monkeypatch.setattr(build, "make_kernel", lambda *a: names.append(a[1]) or EmulatedKernel(*a))
    clear_kernel_caches()
    model = make_model("qwen3")
    with caplog.at_level(logging.WARNING, logger="pagedmlx"):
        engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64, max_model_len=256,
                                                     kv_cache_dtype=kv_cache_dtype))
    plan = engine.runner.kernels
    # int4 of float32 head_dim 32: 4 channels a lane fill no word, so decode rows gather (reading after `written`)
    assert plan.decode == (bits == 8) and plan.page_write and engine.runner.pages_in_place
    assert plan.quantize_in_write == gpu_quantizer and engine.runner.kv_pool.quantize_in_write == gpu_quantizer
    assert any(label.startswith(f"page write int{bits}/32") and r == "passed" for label, r in plan.checks)
    warnings = [r.getMessage() for r in caplog.records if r.filename == "selector.py"]
    line = kernel_path_lines(engine.runner)[0]
    if gpu_quantizer:
        assert not warnings and "page write kernel, in place, quantizing the rows" in line
    else:
        assert "quantizing page write off" in warnings[0] and "differ from a scatter" in plan.quantizing_reason
        assert "page write kernel, in place, after mx.quantize (quantizing page write" in line
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 3], list(range(11, 30))]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy)
    before = len(EmulatedKernel.sources)
    done = run_to_completion(engine)
    for i, p in enumerate(prompts):
        assert_greedy(done[str(i)].token_ids, p, 6, mlx_lm_quantized(model, bits, 32), i, QUANTIZED_GAP)
    ran = EmulatedKernel.sources[before:]  # the write that ran in the steps
    assert any("w_min = fminf" in text or "w_min = metal::min" in text for text in ran) == gpu_quantizer
    assert any("k_q[src * KW + d]" in text for text in ran) != gpu_quantizer
    clear_kernel_caches()


def test_the_quantized_pages_checks_are_kept_once_all_passed(monkeypatch, tmp_path):
    """select_quantized's checks, once all passed here, are kept (runner/check_cache.py): a second start decides the
    same plan without running them. A start where one failed keeps nothing, and runs them all again next time."""
    from pagedmlx.kernels import check, selector

    monkeypatch.setenv("PAGEDMLX_CHECK_CACHE", "1")
    monkeypatch.setenv("PAGEDMLX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "gpu_backend", lambda: CUDA)
    monkeypatch.setattr(selector, "device_name", lambda: "NVIDIA H200")
    plan = selector.select_kernels([(8, 128, 128, mx.bfloat16)], [32], 16, quantized=True)
    runs, decode_err = [], [None]
    monkeypatch.setattr(check, "check_decode_quantized", lambda *a: runs.append("decode") or decode_err[0])
    monkeypatch.setattr(check, "check_prefill", lambda *a, quant=None: runs.append("prefill"))
    monkeypatch.setattr(check, "check_page_write_quantized", lambda *a, quantizing=False: runs.append("write"))
    first = selector.select_quantized(plan, [((8, 128, 128, mx.bfloat16), 32, KVQuant(8, 128))], 16, "int8")
    ran = len(runs)
    second = selector.select_quantized(plan, [((8, 128, 128, mx.bfloat16), 32, KVQuant(8, 128))], 16, "int8")
    assert ran >= 4 and len(runs) == ran and first == second and second.decode and second.prefill
    decode_err[0] = "max |difference| 1"
    layers = [((8, 128, 128, mx.bfloat16), 32, KVQuant(4, 64))]  # another key
    for _ in range(2):
        assert not selector.select_quantized(plan, layers, 16, "int4").decode
    assert len(runs) == 3 * ran


def test_a_dry_pass_keeps_no_pass_of_the_quantized_pages_checks(monkeypatch, tmp_path):
    """The dry pass before a prebuild (disk_cache.prebuild_met) counts every check as passed; none of that is kept:
    the real selection after it runs the checks."""
    from pagedmlx.kernels import check, disk_cache, selector

    monkeypatch.setenv("PAGEDMLX_CHECK_CACHE", "1")
    monkeypatch.setenv("PAGEDMLX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setattr(disk_cache, "_compiler", lambda: object())
    monkeypatch.setattr(build, "gpu_backend", lambda: CUDA)
    monkeypatch.setattr(selector, "device_name", lambda: "NVIDIA H200")
    plan = selector.select_kernels([(8, 128, 128, mx.bfloat16)], [32], 16, quantized=True)
    runs = []
    monkeypatch.setattr(check, "check_decode_quantized", lambda *a: runs.append("decode") or "max |difference| 1")
    monkeypatch.setattr(check, "check_prefill", lambda *a, quant=None: runs.append("prefill"))
    monkeypatch.setattr(check, "check_page_write_quantized", lambda *a, quantizing=False: runs.append("write"))
    layers = [((8, 128, 128, mx.bfloat16), 32, KVQuant(8, 128))]
    seen = []
    disk_cache.prebuild_met(lambda: seen.append(selector.select_quantized(plan, layers, 16, "int8")))
    assert seen[0].decode and not disk_cache.collecting()  # the dry pass: its failing check counted as passed
    ran = len(runs)
    assert not selector.select_quantized(plan, layers, 16, "int8").decode and len(runs) > ran  # run for real
