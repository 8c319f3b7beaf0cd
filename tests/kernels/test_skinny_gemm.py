"""The skinny GEMM (kernels/skinny_gemm.py: x @ W^T over 1-8 rows in one launch of ours, one source for CUDA and
Metal) run on the CPU in the kernel emulator: its load-time check passes against MLX's matmul and fails kernels
that are wrong in the ways a kernel goes wrong; linear layers swapped to it (layers/skinny_linear.py) give a busy
engine mlx-lm's own tokens, and where no kernel runs the engine says why and keeps MLX's matmul."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from kernel_emulator import EmulatedKernel, have_compiler
from utils import assert_no_leaks, assert_solo_greedy, make_model, run_staggered, shared_prefix_prompts, fast_first

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.kernels import build, skinny_gemm
from pagedmlx.kernels.dialect import CUDA, METAL, foreign_names, leftover_tokens
from pagedmlx.kernels.sources import skinny_gemm as gemm_source
from pagedmlx.layers import skinny_linear
from pagedmlx.runner.kernel_paths import kernel_path_lines
from pagedmlx.sampling_params import SamplingParams

needs_compiler = pytest.mark.skipif(not have_compiler(), reason="g++ runs the emulated kernels")


@pytest.fixture
def emulated(monkeypatch):
    """The lanes' kernel in the emulator (the tensor-core one is PTX: nvcc compiles it, tests/test_cuda_sources.py,
    and its load-time check runs on the device)."""
    monkeypatch.setattr(build, "make_kernel", EmulatedKernel)
    monkeypatch.setenv("PAGEDMLX_SKINNY_MMA", "0")
    skinny_gemm._kernel.cache_clear()
    yield
    skinny_gemm._kernel.cache_clear()


@pytest.mark.parametrize("backend", [METAL, CUDA])
def test_the_source_renders_for_each_backend_and_names_nothing_of_the_other(backend):
    text = skinny_gemm.skinny_gemm_source(backend)
    assert not leftover_tokens(text) and not foreign_names(text, backend)


def test_the_tensor_core_source_renders_for_cuda():
    text = skinny_gemm.skinny_gemm_source(CUDA, mma=True)
    assert "asm" not in text and "skinny_mma(" in text  # the PTX is in the header (MMA_HEADER), the body calls it
    assert not leftover_tokens(text) and not foreign_names(text, CUDA)


def test_supported_shapes():
    """2-8 rows (one row is MLX's own gemv), float32 or bfloat16 weights, K a whole number of a lane's 16-byte
    loads (SmolLM2's 576 too: the last step of K has fewer lanes)."""
    w = mx.zeros((16, 256), mx.bfloat16)
    assert skinny_gemm.supports(2, w) and skinny_gemm.supports(8, w)
    assert not skinny_gemm.supports(9, w) and not skinny_gemm.supports(1, w)
    assert not skinny_gemm.supports(2, w.astype(mx.float16))
    assert skinny_gemm.supports(2, mx.zeros((16, 576), mx.bfloat16))
    assert not skinny_gemm.supports(2, mx.zeros((16, 196), mx.bfloat16))  # 196 bf16: not whole 8-value loads
    assert skinny_gemm.supports(2, mx.zeros((16, 132), mx.float32))
    assert not skinny_gemm.supports(2, mx.zeros((16, 130), mx.float32))


def test_tensor_cores_are_opt_in_on_cuda_and_take_16_bit_weights(monkeypatch):
    """PAGEDMLX_SKINNY_MMA=1: CUDA's 16-bit weights with K whole 32-value chunks take the tensor-core kernel (float16
    too); never on Metal, never float32."""
    w16 = mx.zeros((16, 96), mx.float16)
    assert not skinny_gemm.uses_tensor_cores(CUDA, w16) and not skinny_gemm.supports(2, w16, CUDA)
    monkeypatch.setenv("PAGEDMLX_SKINNY_MMA", "1")
    assert skinny_gemm.uses_tensor_cores(CUDA, w16) and skinny_gemm.supports(8, w16, CUDA)
    assert not skinny_gemm.supports(9, w16, CUDA)
    assert not skinny_gemm.uses_tensor_cores(METAL, w16) and not skinny_gemm.supports(2, w16, METAL)
    assert not skinny_gemm.uses_tensor_cores(CUDA, mx.zeros((16, 96), mx.float32))
    assert not skinny_gemm.uses_tensor_cores(CUDA, mx.zeros((16, 80), mx.bfloat16))  # K not whole 32-value chunks
    assert skinny_gemm.kernel_dtypes(CUDA) == {mx.float32, mx.bfloat16, mx.float16}
    assert skinny_gemm.kernel_dtypes(METAL) == {mx.float32, mx.bfloat16}


@needs_compiler
@pytest.mark.parametrize("backend,dtype", [(CUDA, mx.bfloat16), (METAL, mx.float32)])
@pytest.mark.parametrize("per_warp,split", fast_first(2, [(1, 1), (1, 4), (2, 1), (4, 1), (2, 2), (4, 4)]))
def test_emulated_kernel_passes_its_check(emulated, monkeypatch, backend, dtype, per_warp, split):
    """Each number of columns a SIMD group computes (rows_per_warp's choices, forced at a small N) and each split of
    K (k_split's, forced); 44 columns: no whole number of a group's 4, 8 or 16 (or a split group's 1, 2 or 4), so the
    last group's guard is exercised."""
    monkeypatch.setattr(skinny_gemm, "rows_per_warp", lambda n: per_warp)
    monkeypatch.setattr(skinny_gemm, "k_split", lambda n, k, dt, rows: split)
    assert skinny_gemm.check_skinny_gemm(backend, ((44, 1024), (44, 576)), dtype, rows_checked=(2, 3, 8)) is None


def test_narrow_products_spread_over_more_simd_groups():
    """Llama-8B's k/v (1,024 columns) one column a SIMD group; q/o (4,096) two; gate/up, the head four. Its q/k/v,
    o and down products split K four ways (up to SPLIT_WARPS SIMD groups), gate/up two, the head not at all, from 4
    rows (a verifying step of k 4 has 5); a short K is not split below 4 steps a SIMD group."""
    assert [skinny_gemm.rows_per_warp(n) for n in (1024, 4096, 14336, 128256)] == [1, 2, 4, 4]
    bf16 = mx.bfloat16
    shapes = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (4096, 1024), (4096, 2048))
    assert [skinny_gemm.k_split(n, k, bf16, 5) for n, k in shapes] == [4, 4, 2, 4, 1, 1, 2]
    assert [skinny_gemm.k_split(n, k, bf16, 4) for n, k in shapes] == [4, 4, 2, 4, 1, 1, 2]
    assert {skinny_gemm.k_split(n, k, bf16, rows) for n, k in shapes for rows in (2, 3)} == {1}


@needs_compiler
@pytest.mark.parametrize("original,wrong,dtype", [
    ("o = 16; o > 0", "o = 8; o > 0", mx.float32),  # half the lanes' sums
    ("k += STEP", "k += 2 * STEP", mx.float32),  # every other step of K
    ("(words[j >> 1] & 0xffff0000u) : (words[j >> 1] << 16)", "(words[j >> 1] << 16) : (words[j >> 1] & 0xffff0000u)",
     mx.bfloat16),  # a weight word's two bf16 values swapped
    ("acc[m][r] += xv * wf[r][j]", "acc[m][r] += xv * wf[0][j]", mx.float32),  # every column takes the first's row
    ("parts[SIMD_ID + p]", "parts[SIMD_ID]", mx.float32),  # a split's first part counted for all of them
    ("(part * 32 + LANE) * VEC", "LANE * VEC", mx.float32),  # every part of a split takes the same steps
])
def test_the_check_fails_a_wrong_kernel(emulated, monkeypatch, original, wrong, dtype):
    assert original in gemm_source.SKINNY_GEMM
    monkeypatch.setattr(gemm_source, "SKINNY_GEMM", gemm_source.SKINNY_GEMM.replace(original, wrong, 1))
    monkeypatch.setattr(skinny_gemm, "rows_per_warp", lambda n: 4)  # every column of a SIMD group distinct
    monkeypatch.setattr(skinny_gemm, "k_split", lambda n, k, dt, rows: 2)
    err = skinny_gemm.check_skinny_gemm(CUDA, ((16, 1024),), dtype, rows_checked=(3,))
    assert err is not None and "max relative difference" in err


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "min_acceptance_rate": 0.0}


@needs_compiler
@pytest.mark.parametrize("speculative", fast_first(1, [None, NGRAM], unpack=False), ids=["plain", "ngram"])
def test_busy_engine_with_skinny_products_equals_mlx_lm_alone(emulated, monkeypatch, speculative):
    """Every request's tokens equal mlx-lm's generation alone on the same model object (greedy, float32), which
    the swapped layers leave as it was outside skinny_products(); the kernel ran for the few-row products: decodes
    of several requests, and with n-gram speculation the verifying steps' 1 + k rows a request."""
    model = make_model("llama-small", seed=21)  # a model of its own: its layers' classes are swapped for good
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=128, max_num_seqs=4, max_model_len=256,
                                                 compile_decode=False,  # the emulator evaluates: no traces
                                                 speculative_config=speculative))
    runner = engine.runner
    assert not runner.skinny  # off by default on the CPU
    monkeypatch.setattr(build, "gpu_backend", lambda: CUDA)
    assert skinny_linear.use_skinny_gemm(True, model, True)
    monkeypatch.undo()
    monkeypatch.setattr(build, "make_kernel", EmulatedKernel)
    runner.skinny = True
    assert "products of 2-5 rows: skinny GEMM kernel" in "\n".join(kernel_path_lines(runner))  # the start-up lines
    rows, real = [], skinny_gemm.skinny_gemm
    monkeypatch.setattr(skinny_gemm, "skinny_gemm",
                        lambda x, w, b=None: rows.append(x.size // x.shape[-1]) or real(x, w, b))
    prompts = [[t % engine.vocab_size for t in p] for p in shared_prefix_prompts(4, seed=5)]
    done = run_staggered(engine, prompts, GREEDY, seed=2)
    assert rows and min(rows) >= skinny_gemm.MIN_ROWS and max(rows) <= skinny_linear.MAX_ROWS == 5
    assert speculative is None or engine.scheduler.spec_decoding_stats.num_drafts > 0
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, GREEDY.max_tokens, f"request {i}")
    assert_no_leaks(engine)
    skinny_linear.drop_skinny_gemm(model)
    assert all(type(m) is nn.Linear for m in skinny_linear._linears(model))


@needs_compiler
def test_on_by_default_on_cuda_only(emulated, monkeypatch, caplog):
    """EngineConfig.skinny_gemm None: swapped on CUDA (its check passing, in the emulator), silently not on Metal, with
    kernels off, or for a model whose weights it does not take; asked for explicitly, Metal swaps too."""
    model = make_model("llama-small", seed=23)  # widths of 256 and 512: whole steps of the kernel's float32 SIMD group
    monkeypatch.setattr(build, "gpu_backend", lambda: METAL)
    assert not skinny_linear.use_skinny_gemm(None, model, True) and "skinny_gemm" not in caplog.text
    monkeypatch.setattr(build, "gpu_backend", lambda: CUDA)
    assert not skinny_linear.use_skinny_gemm(None, model, False) and "skinny_gemm" not in caplog.text
    assert skinny_linear.use_skinny_gemm(None, model, True)
    assert all(type(m) is skinny_linear.SkinnyLinear for m in skinny_linear._linears(model))
    skinny_linear.drop_skinny_gemm(model)
    half = make_model("llama-small", seed=25)
    half.set_dtype(mx.float16)  # the lanes' kernel takes bfloat16 and float32
    narrow = make_model("llama-small", seed=26)
    monkeypatch.setattr(skinny_gemm, "supports", lambda rows, w, b=None: False)  # as for widths of no whole loads
    with caplog.at_level("WARNING", logger="pagedmlx"):
        assert not skinny_linear.use_skinny_gemm(None, half, True) and "skinny_gemm" not in caplog.text
        assert not skinny_linear.use_skinny_gemm(None, narrow, True) and "skinny_gemm" not in caplog.text
        assert not skinny_linear.use_skinny_gemm(True, half, True) and "weights in ['mlx.core.float16']" in caplog.text
        assert not skinny_linear.use_skinny_gemm(True, narrow, True) and "of a width the kernel takes" in caplog.text
    assert not any(type(m) is skinny_linear.SkinnyLinear for m in skinny_linear._linears(narrow))


@needs_compiler
def test_only_layers_of_widths_the_kernel_takes_are_swapped(emulated, monkeypatch):
    """A model with some widths the kernel does not take (SmolLM2's 576) swaps the others only, and checks only
    theirs."""
    model = make_model("llama-small", seed=27)
    monkeypatch.setattr(build, "gpu_backend", lambda: CUDA)
    real, checked = skinny_gemm.supports, []
    monkeypatch.setattr(skinny_gemm, "supports", lambda rows, w, b=None: w.shape[1] != 512 and real(rows, w, b))
    monkeypatch.setattr(skinny_gemm, "check_skinny_gemm", lambda b, shapes, dt, rows_checked: checked.extend(shapes))
    assert skinny_linear.use_skinny_gemm(None, model, True)
    swapped = [m.weight.shape[1] for m in skinny_linear._linears(model) if type(m) is skinny_linear.SkinnyLinear]
    kept = [m.weight.shape[1] for m in skinny_linear._linears(model) if type(m) is nn.Linear]
    assert swapped and set(swapped) == {256} and kept and set(kept) == {512}
    assert checked and {k for _, k in checked} == {256}
    skinny_linear.drop_skinny_gemm(model)


def test_a_kernel_that_does_not_build_is_a_reason_not_a_crash():
    """No CUDA back-end here: the check says so, as NVRTC's errors would be said on a device."""
    skinny_gemm._kernel.cache_clear()
    why = skinny_gemm.check_skinny_gemm(CUDA, ((16, 256),))
    assert why is not None and why.startswith("did not compile or run (RuntimeError: ")


def test_the_load_time_check_builds_only_the_row_counts_the_engine_gives(monkeypatch):
    checked = []
    monkeypatch.setattr(build, "gpu_backend", lambda: CUDA)
    monkeypatch.setattr(skinny_gemm, "check_skinny_gemm", lambda b, shapes, dt, rows_checked: checked.append(
        list(rows_checked)) or "stop here")
    assert not skinny_linear.use_skinny_gemm(True, make_model("llama-small", seed=24), True)
    assert checked == [list(range(2, skinny_linear.MAX_ROWS + 1))] == [[2, 3, 4, 5]]


def test_more_rows_than_the_engine_gives_the_kernel_take_mlx_matmul(monkeypatch):
    """Past skinny_linear.MAX_ROWS a swapped layer runs nn.Linear's own product even inside skinny_products()."""
    layer = nn.Linear(256, 16)
    layer.__class__, layer._pagedmlx_backend = skinny_linear.SkinnyLinear, CUDA
    called = []
    monkeypatch.setattr(skinny_gemm, "skinny_gemm", lambda x, w, b=None: called.append(x.shape[0]) or x @ w.T)
    x = mx.random.normal((skinny_linear.MAX_ROWS + 1, 256))
    with skinny_linear.skinny_products():
        assert mx.allclose(layer(x), x @ layer.weight.T + layer.bias)
        layer(x[:2])
    assert called == [2]


def test_asked_for_where_no_kernel_runs_the_engine_says_why_and_keeps_mlx_matmul(caplog):
    model = make_model("llama", seed=22)
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=32, skinny_gemm=True))
    assert not engine.runner.skinny and "skinny_gemm): it needs a GPU backend's kernels" in caplog.text
    assert not any(type(m) is skinny_linear.SkinnyLinear for m in skinny_linear._linears(model))
