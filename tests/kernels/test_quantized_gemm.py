"""The quantized GEMM (kernels/quantized_gemm.py: MLX's affine 4- and 8-bit weights dequantized in registers and
multiplied on tensor cores) run on the CPU in the kernel emulator, its PTX helpers emulated
(tests/kernel_emulator/mma.py): its load-time check passes against MLX's quantized matmul for every format, row
count and launch shape, and fails kernels that are wrong in the ways a kernel goes wrong; quantized layers swapped
to it (layers/quantized_linear.py) give a busy engine mlx-lm's own tokens; where it cannot run the engine keeps
MLX's product. What only the GPU shows: the real PTX, NVRTC's compile and speed
(scripts/bench/bench_quantized_gemm.py)."""

from __future__ import annotations

import functools
import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from kernel_emulator import have_compiler
from utils import (assert_no_leaks, emulated_busy_engine, fast_first, float32_quantized_matmul, make_prompts,
                   run_staggered, solo_mismatch)

from pagedmlx.bench.presets import Quantization, quantize_model
from pagedmlx.kernels import build, launch_configs, quantized_gemm
from pagedmlx.kernels.dialect import CUDA, foreign_names, leftover_tokens
from pagedmlx.kernels.sources import quantized_gemm_cuda as gemm_src
from pagedmlx.layers import quantized_linear
from pagedmlx.loaders.random_model import build_model
from pagedmlx.runner import verify
from pagedmlx.runner.kernel_paths import kernel_path_lines
from pagedmlx.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not have_compiler(), reason="g++ runs the emulated kernels")


def test_the_source_renders_for_cuda_and_names_nothing_of_metal():
    text = quantized_gemm.quantized_gemm_source()
    assert not leftover_tokens(text) and not foreign_names(text, CUDA) and "mma16816_rows(" in text


def test_supported_formats():
    assert quantized_gemm.supports(64, 4096, mx.bfloat16, 4, 64)
    assert quantized_gemm.supports(1, 14336, mx.float16, 8, 128)
    assert not quantized_gemm.supports(quantized_gemm.MAX_ROWS + 1, 4096, mx.bfloat16, 4, 64)  # a long chunk: MLX's
    assert not quantized_gemm.supports(8, 4096, mx.float32, 4, 64)  # float32 scales
    assert not quantized_gemm.supports(8, 4096, mx.bfloat16, 3, 64)
    assert not quantized_gemm.supports(8, 4096, mx.bfloat16, 4, 32, mode="mxfp4")
    assert not quantized_gemm.supports(8, 4112, mx.bfloat16, 4, 16)  # no 32-value runs in one group


def test_a_launch_splits_k_by_the_weights_shape_only():
    """k_splits depends on (N, K) alone, so a row's float sums are the same whatever the step's row count; row
    tiles grow with the rows up to MAX_TILES; narrow products split K to fill the GPU, each split 4+ chunks."""
    for n, k in ((1024, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (64, 256)):
        launches = [quantized_gemm.launch_for(n, k, rows, 4, 64) for rows in range(1, quantized_gemm.MAX_ROWS + 1)]
        assert {launch.ks for launch in launches} == {quantized_gemm.k_splits(n, k)}
        assert [launch.mt for launch in launches][:18:8] == [1, 2, 4]
        assert max(launch.mt for launch in launches) == quantized_gemm.MAX_TILES
        assert all(-(-k // 128) >= 4 * launch.ks or launch.ks == 1 for launch in launches)
    assert quantized_gemm.k_splits(4096, 4096) > 1 and quantized_gemm.k_splits(128256, 4096) == 1


TUNED = {"device_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0",
         "shapes": {"96,512,4,64": {"ks": 2, "rows": {"1": [1, 4, 4], "16": [2, 2, 3], "64": [4, 2, 2]}}}}


def test_a_tuned_config_gives_its_launches_by_row_count_with_one_split_of_k(monkeypatch):
    """kernels/launch_configs.py: a shape tuned on this GPU takes its launch for the fewest tuned rows at or above the
    step's (the most tuned past them), always with the shape's one ks; an untuned shape or format keeps the rules."""
    monkeypatch.setattr(launch_configs, "load", lambda kernel: TUNED)
    quantized_gemm.launch_for.cache_clear()
    try:
        got = {r: quantized_gemm.launch_for(96, 512, r, 4, 64) for r in (1, 2, 16, 17, 64, 200)}
        assert got == {1: quantized_gemm.Launch(1, 4, 2, 4), 2: quantized_gemm.Launch(2, 2, 2, 3),
                       16: quantized_gemm.Launch(2, 2, 2, 3), 17: quantized_gemm.Launch(4, 2, 2, 2),
                       64: quantized_gemm.Launch(4, 2, 2, 2), 200: quantized_gemm.Launch(4, 2, 2, 2)}
        assert quantized_gemm.launch_for(96, 512, 9, 8, 64) == quantized_gemm.Launch(2, quantized_gemm.WARPS, 1)
    finally:
        quantized_gemm.launch_for.cache_clear()


def test_a_config_is_found_by_device_name_else_by_compute_capability(tmp_path):
    for name, capability in (("NVIDIA H100 80GB HBM3", "9.0"), ("NVIDIA A100-SXM4-80GB", "8.0")):
        path = tmp_path / launch_configs.file_name("quantized_gemm", name)
        path.write_text(json.dumps({**TUNED, "device_name": name, "compute_capability": capability}))
    assert path.name == "quantized_gemm-NVIDIA_A100_SXM4_80GB.json"
    find = functools.partial(launch_configs.find, "quantized_gemm", folder=tmp_path)
    assert find("NVIDIA H100 80GB HBM3", "9.0")["device_name"] == "NVIDIA H100 80GB HBM3"
    assert find("NVIDIA H200", "9.0")["device_name"] == "NVIDIA H100 80GB HBM3"  # the same compute capability
    assert find("NVIDIA L4", "8.9") == {}


def test_a_tuned_config_folder_is_searched_before_the_packages_own_and_changes_the_check_key(tmp_path, monkeypatch):
    from pagedmlx.runner import check_cache

    assert launch_configs.folders() == [launch_configs.CONFIG_DIR]
    before = check_cache.source_digest()
    path = tmp_path / launch_configs.file_name("quantized_gemm", "NVIDIA H100 80GB HBM3")
    path.write_text(json.dumps(TUNED))
    monkeypatch.setenv("PAGEDMLX_TUNED_CONFIG_FOLDER", str(tmp_path))
    check_cache.source_digest.cache_clear()
    try:
        assert launch_configs.folders() == [tmp_path, launch_configs.CONFIG_DIR]
        assert check_cache.source_digest() != before  # a pass with other launches is another key
    finally:
        monkeypatch.delenv("PAGEDMLX_TUNED_CONFIG_FOLDER")
        check_cache.source_digest.cache_clear()
    assert check_cache.source_digest() == before


@pytest.mark.parametrize("bits", [4, 8])
def test_the_check_covers_a_tuned_configs_launches(emulated_gemm, bits):
    """The load-time check runs the launches the config gives at the check's row counts, so a tuned launch runs only
    once proven (here: right, and wrong where the kernel is)."""
    tuned = {"shapes": {f"96,512,{bits},64": TUNED["shapes"]["96,512,4,64"]}}
    emulated_gemm.setattr(launch_configs, "load", lambda kernel: tuned)
    quantized_gemm.launch_for.cache_clear()
    try:
        assert quantized_gemm.check_quantized_gemm([(96, 512, bits, 64)], mx.bfloat16, rows_checked=(1, 9, 33)) is None
        emulated_gemm.setattr(gemm_src, "QUANTIZED_GEMM", gemm_src.QUANTIZED_GEMM.replace(
            "for (int z = 0; z < KS; ++z)", "for (int z = 1; z < KS; ++z)", 1))
        quantized_gemm._kernel.cache_clear()
        err = quantized_gemm.check_quantized_gemm([(96, 512, bits, 64)], mx.bfloat16, rows_checked=(33,))
        assert err is not None and "max relative difference" in err
    finally:
        quantized_gemm.launch_for.cache_clear()


FORMATS = [(4, 64, mx.bfloat16), (4, 32, mx.bfloat16), (4, 128, mx.float16), (8, 64, mx.bfloat16),
           (8, 32, mx.float16)]
LAUNCHES = [None, quantized_gemm.Launch(2, 2, 3, 3), quantized_gemm.Launch(4, 4, 1)]  # stages 2 and 4 by default


@pytest.mark.parametrize("bits,group_size,dtype", fast_first(1, FORMATS))
@pytest.mark.parametrize("launch", fast_first(1, LAUNCHES, unpack=False), ids=["default", "mt2-wn2-ks3-st3", "mt4-wn4"])
def test_emulated_kernel_passes_its_check(emulated_gemm, bits, group_size, dtype, launch):
    """Against MLX's quantized matmul in float32 on the same weights, at the tolerance of the output's dtype
    (rounding it is 2e-3 of bf16's largest magnitude): N not a whole number of tiles, K a whole number of
    32-value runs but not of a warp's 128-value chunks, rows of partial tiles and of several blocks."""
    if launch is not None:
        emulated_gemm.setattr(quantized_gemm, "launch_for", lambda *shape: launch)
    # every launch: the same counters
    emulated_gemm.setattr(quantized_gemm, "_counters", quantized_gemm._CounterRing(8))
    k = 1024 + max(group_size, 64)  # past whole 128-value chunks, but for group size 128
    assert quantized_gemm.check_quantized_gemm([(40, k, bits, group_size)], dtype,
                                               rows_checked=(1, 2, 9, 17, 40)) is None


@pytest.mark.parametrize("bits,original,wrong,ks", [(*case, 2)[:4] for case in [
    (8, "(q >> (2 * i * BITS)) & MASK", "(q >> ((2 * i + 1) * BITS)) & MASK"),  # a pair's two values swapped
    (4, "(q >> (4 * i)) & 0x000F000Fu", "(q >> (4 * i)) & 0x00F0000Fu"),  # a pair's second value misread
    (4, "__byte_perm(u.x, u.z, 0x5410), __byte_perm(u.x, u.z, 0x7632)", "u.x, u.y"),  # x's pairs not regrouped
    (4, "c_end = IMIN(c_begin + per_split, chunks)", "c_end = IMIN(c_begin + per_split / 2, chunks)"),  # half of K
    (4, "sraw[n * row_groups + kl / GS]", "sraw[n * row_groups + c * 128 / GS]"),  # the chunk's first group's
    (8, "braw[n * row_groups + kl / GS]", "braw[n * row_groups + c * 128 / GS]"),
    (4, "xs[slot * SLOT + base + ((j2 + t) & 3)]", "xs[slot * SLOT + base + j2]"),  # x's pieces read unrotated
    (4, "u = xs[slot * SLOT + base", "u = xs[(slot + 1) % ST * SLOT + base"),  # another chunk's x
    (4, "r * 20 + 4 * s + ((u + s) & 3)", "r * 20 + 4 * s + u"),  # stored unrotated
    (4, "issue(c0 + s + ST - 1, (s + ST - 1) % ST)", "issue(c0 + s + ST - 1, (s + ST - 2) % ST)"),  # a live slot
    (8, "if (c0 + s >= c_end) break;", "if (c0 + s + 1 >= c_end) break;"),  # the last chunk dropped
    (4, "{q[slot][h][v].x,", "{q[(slot + 1) % ST][h][v].x,"),  # another chunk's weights
    (4, "for (int z = 0; z < KS; ++z)", "for (int z = 1; z < KS; ++z)"),  # a split's partials left out of y
    (4, "1) == KS - 1;", "1) == KS - 2;", 3),  # the tile written before its last split is in
    (4, "*count = 0;", "*count += 0;"),  # the counters not zeroed for the ring's next lap
    (4, "const int base = (mt * 8 + g) * 20", "const int base = g * 20"),  # every row tile reads the first's rows
    (4, "{a[0][4 * j2], a[1][4 * j2], a[0][4 * j2 + 1], a[1][4 * j2 + 1]}",
     "{a[1][4 * j2], a[0][4 * j2], a[0][4 * j2 + 1], a[1][4 * j2 + 1]}"),  # A's rows mixed
]])
def test_the_check_fails_a_wrong_kernel(emulated_gemm, bits, original, wrong, ks):
    name = next(n for n in ("QUANTIZED_GEMM", "QUANTIZED_GEMM_HEADER") if original in getattr(gemm_src, n))
    emulated_gemm.setattr(gemm_src, name, getattr(gemm_src, name).replace(original, wrong, 1))
    emulated_gemm.setattr(quantized_gemm, "launch_for", lambda *shape: quantized_gemm.Launch(2, 2, ks))
    # the next launch: the same counter
    emulated_gemm.setattr(quantized_gemm, "_counters", quantized_gemm._CounterRing(1))
    err = quantized_gemm.check_quantized_gemm([(32, 1024, bits, 64)], mx.bfloat16, rows_checked=(16, 9))
    assert err is not None and "max relative difference" in err


def test_a_kernel_that_does_not_build_is_a_reason_not_a_crash(emulated_gemm):
    emulated_gemm.setattr(gemm_src, "QUANTIZED_GEMM", gemm_src.QUANTIZED_GEMM + "\n    no_such_function();")
    err = quantized_gemm.check_quantized_gemm([(32, 512, 4, 64)], mx.bfloat16, rows_checked=(2,))
    assert err is not None and err.startswith("did not compile or run")


LLAMA = dict(model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _quantized_model(seed: int, quantization: Quantization = Quantization(4, 64)) -> nn.Module:
    model = build_model(LLAMA, seed=seed)
    model.set_dtype(mx.bfloat16)
    quantize_model(model, quantization)  # as the quantized presets and mlx-lm's convert do
    return model


def _cpu():
    return None




def test_busy_engine_with_the_kernel_equals_mlx_lm_alone(emulated_gemm):
    """A bf16 4-bit model with 8-bit embeddings and head: every quantized product of 1-256 rows of the engine's
    steps (decodes of up to 8 requests beside chunked prompts, merged projections) runs the kernel, and each
    request's tokens are mlx-lm's for its prompt alone, up to rounding's near ties; MLX's own products (mlx-lm's)
    sum in float32 as on the GPU (utils.float32_quantized_matmul)."""
    emulated_gemm.setattr(mx, "quantized_matmul", float32_quantized_matmul())
    model = _quantized_model(31, Quantization(4, 64, head_bits=8))
    engine = emulated_busy_engine(model)
    runner = engine.runner
    assert not runner.quantized_gemm  # off by default on the CPU
    emulated_gemm.setattr(build, "gpu_backend", lambda: CUDA)
    runner.quantized_gemm = quantized_linear.use_quantized_gemm(True, model, True)  # its check, emulated
    emulated_gemm.setattr(build, "gpu_backend", _cpu)
    assert runner.quantized_gemm
    assert "quantized products of 1-256 rows: quantized GEMM kernel" in "\n".join(kernel_path_lines(runner))
    rows, real = [], quantized_gemm.quantized_gemm
    emulated_gemm.setattr(quantized_gemm, "quantized_gemm", lambda x, *a, **k: rows.append(x.size // x.shape[-1])
                     or real(x, *a, **k))
    prompts = [p[:40] for p in make_prompts(10, LLAMA["vocab_size"], seed=13)]
    done = run_staggered(engine, prompts, GREEDY, seed=3)
    assert 1 in rows and max(rows) > 8  # one-row steps (the last request's decodes) take it too
    for i, p in enumerate(prompts):
        why = solo_mismatch(done[str(i)], model, p, GREEDY.max_tokens)
        assert why is None, f"request {i}: {why}"
    assert_no_leaks(engine)
    quantized_linear.drop_quantized_gemm(model)
    assert not any(m._kernel for m in quantized_linear._quantized_linears(model))


def test_a_quantized_gemm_the_model_check_refuses_gives_way_to_mlx(emulated_gemm):
    """The model's load-time check keeps a right kernel and refuses one that goes wrong after its own check: its
    reference (mlx-lm against itself over the flattened rows) runs MLX's products, never the kernel it judges."""
    emulated_gemm.setattr(mx, "quantized_matmul", float32_quantized_matmul())
    model = _quantized_model(31)
    runner = emulated_busy_engine(model).runner
    emulated_gemm.setattr(build, "gpu_backend", lambda: CUDA)
    runner.quantized_gemm = quantized_linear.use_quantized_gemm(True, model, True)
    emulated_gemm.setattr(build, "gpu_backend", _cpu)
    verify.verify_against_mlx_lm(runner)
    assert runner.quantized_gemm  # right: kept
    real = quantized_gemm.quantized_gemm
    emulated_gemm.setattr(quantized_gemm, "quantized_gemm", lambda *a, **k: real(*a, **k) * 1.05)
    verify.verify_against_mlx_lm(runner)
    assert not runner.quantized_gemm


def test_on_by_default_on_cuda_only_and_asked_for_elsewhere_says_why(emulated_gemm, caplog):
    model = _quantized_model(33)
    quantized_linear.flatten_quantized(model)
    assert not quantized_linear.use_quantized_gemm(None, model, True)  # the CPU: quietly MLX's
    with caplog.at_level("WARNING", logger="pagedmlx"):
        assert not quantized_linear.use_quantized_gemm(True, model, True)
    assert "quantized_gemm): it needs CUDA's kernels" in caplog.text
    emulated_gemm.setattr(build, "gpu_backend", lambda: CUDA)
    assert not quantized_linear.use_quantized_gemm(None, model, False)  # kernels off
    checked = []
    emulated_gemm.setattr(quantized_gemm, "check_quantized_gemm", lambda shapes, dtype: checked.append(shapes))
    assert quantized_linear.use_quantized_gemm(None, model, True)
    taken = [m for m in quantized_linear._quantized_linears(model) if m._kernel]
    assert len(taken) == 2 * 7 + 1  # each layer's seven projections and the head
    assert checked and all(shape[2:] == (4, 64) for shapes in checked for shape in shapes)


def test_a_failed_check_keeps_mlx_quantized_matmul(emulated_gemm, caplog):
    model = _quantized_model(35)
    quantized_linear.flatten_quantized(model)
    emulated_gemm.setattr(build, "gpu_backend", lambda: CUDA)
    emulated_gemm.setattr(quantized_gemm, "check_quantized_gemm", lambda shapes, dtype: "max relative difference 1")
    with caplog.at_level("WARNING", logger="pagedmlx"):
        assert not quantized_linear.use_quantized_gemm(None, model, True)
    assert "left to MLX's quantized matmul (quantized_gemm): max relative difference 1" in caplog.text
    assert not any(m._kernel for m in quantized_linear._quantized_linears(model))


def test_a_passed_check_is_kept_and_a_failed_one_runs_again(emulated_gemm, tmp_path):
    """runner/check_cache.py keeps the check's pass for the same shapes, source, MLX and device; a failure is not
    kept."""
    emulated_gemm.setenv("PAGEDMLX_CACHE_DIR", str(tmp_path))
    emulated_gemm.delenv("PAGEDMLX_CHECK_CACHE", raising=False)
    emulated_gemm.setattr(build, "gpu_backend", lambda: CUDA)
    results, runs = ["max relative difference 1", None, None], []
    emulated_gemm.setattr(quantized_gemm, "check_quantized_gemm", lambda shapes, dtype: runs.append(shapes)
                     or results[len(runs) - 1])
    model = _quantized_model(37)
    quantized_linear.flatten_quantized(model)
    assert [quantized_linear.use_quantized_gemm(None, model, True) for _ in range(3)] == [False, True, True]
    assert len(runs) == 2
