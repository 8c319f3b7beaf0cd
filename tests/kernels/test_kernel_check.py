"""The load-time kernel check, on the CPU: the engine believes it runs on Metal, and its paged
kernels are stand-ins. Kernels that pass (the real source, emulated: tests/kernel_emulator) serve
decode rows; kernels that fail to compile or disagree are switched off with one warning line, and
the gather path serves. Either way every token equals mlx-lm's own greedy generation."""

from __future__ import annotations

import dataclasses
import logging

import mlx.core as mx
import pytest
from utils import assert_solo_greedy, make_model, run_to_completion
from kernel_emulator import EmulatedKernel, have_compiler

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.kernels import build, check, decode_attention, selector
from pagedmlx.runner.kernel_paths import kernel_path_lines

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class BrokenKernel:
    """Fails as a kernel MLX cannot compile fails: when it is first run."""

    def __init__(self, *args):
        pass

    def __call__(self, **call):
        raise RuntimeError("[metal::Device] Unable to build metal library from source\nerror: expected ';'")


class WrongKernel(EmulatedKernel):
    """Compiles and runs, but its decode output is off by 10%."""

    def __call__(self, **call):
        outs = super().__call__(**call)
        return [o * 1.1 if o.dtype != mx.int32 else o for o in outs]


@pytest.fixture
def on_metal(monkeypatch):
    """The runner and the kernels see a Metal GPU; `use(factory)` picks the stand-in kernels."""
    monkeypatch.setattr(build, "gpu_backend", lambda: "metal")
    monkeypatch.delenv("PAGEDMLX_METAL_KERNELS", raising=False)
    calls = []

    def use(factory):
        def make(*args):
            calls.append(args[1])
            return factory(*args)
        monkeypatch.setattr(build, "make_kernel", make)
        decode_attention._kernels.cache_clear()
        decode_attention.supports.cache_clear()
        return calls
    yield use
    decode_attention._kernels.cache_clear()
    decode_attention.supports.cache_clear()


def serve(model) -> LLMEngine:
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64))
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    return engine


def kernel_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.filename == "selector.py"]


def assert_serves_mlx_lms_tokens(engine: LLMEngine, model) -> None:
    """The engine (serve's) runs its prompts to mlx-lm's greedy tokens for each alone."""
    done = run_to_completion(engine)
    assert sorted(done) == [str(i) for i in range(len(PROMPTS))]
    for i, p in enumerate(PROMPTS):
        assert_solo_greedy(done[str(i)].token_ids, model, p, GREEDY.max_tokens, i)


@pytest.mark.parametrize("factory,reason", [(BrokenKernel, "did not compile or run (RuntimeError: [metal::Device]"),
                                            (WrongKernel, "max |difference|")])
def test_a_kernel_that_fails_its_check_is_switched_off_and_the_gather_path_serves(on_metal, caplog, factory, reason):
    if factory is WrongKernel and not have_compiler():
        pytest.skip("g++ runs the emulated kernels")
    on_metal(factory)
    model = make_model("llama")
    with caplog.at_level(logging.WARNING, logger="pagedmlx"):
        engine = serve(model)
    plan = engine.runner.kernels
    assert plan.backend == "metal" and not plan.enabled and engine.runner.kernel_kv_heads == [0]
    assert reason in plan.reason and plan.checks[-1][1].startswith("failed")
    warnings = kernel_warnings(caplog)
    assert len(warnings) == 1 and "metal paged kernels off" in warnings[0] and reason in warnings[0]
    [line] = kernel_path_lines(engine.runner)  # what the server's start-up and `pagedmlx doctor` say
    assert line.endswith(f"decode gather + SDPA; prefill gather + SDPA; page write MLX scatter ({plan.reason})")
    assert_serves_mlx_lms_tokens(engine, model)


@pytest.mark.skipif(not have_compiler(), reason="g++ runs the emulated kernels")
def test_kernels_that_pass_their_check_serve_decode_rows(on_metal, caplog):
    calls = on_metal(EmulatedKernel)
    model = make_model("llama")
    with caplog.at_level(logging.WARNING, logger="pagedmlx"):
        engine = serve(model)
    plan = engine.runner.kernels
    assert plan.decode and not plan.page_write  # Metal: MLX's scatter writes the pages (selector.PAGES_IN_PLACE)
    assert all(result == "passed" for _, result in plan.checks) and not kernel_warnings(caplog)
    [line] = kernel_path_lines(engine.runner)
    assert line.endswith(": decode paged decode kernel; prefill gather + SDPA (the prefill kernel is CUDA only); "
                         "page write MLX scatter (not in place on metal yet)")
    before = len(EmulatedKernel.sources)
    assert_serves_mlx_lms_tokens(engine, model)
    assert len(EmulatedKernel.sources) > before and calls  # decode rows went through the kernel


def test_the_environment_switches_the_kernels_off(on_metal, monkeypatch):
    calls = on_metal(BrokenKernel)
    monkeypatch.setenv("PAGEDMLX_METAL_KERNELS", "0")
    engine = serve(make_model("llama"))
    assert engine.runner.kernels.reason == "PAGEDMLX_METAL_KERNELS=0" and not calls


def test_cuda_kernels_on_the_trusted_gpu_skip_the_check_and_are_checked_elsewhere(monkeypatch):
    monkeypatch.setattr(build, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(check, "run_checks", lambda *a, **k: iter([("decode", False, "disagrees")]))
    specs, heads = [(8, 128, 128, mx.bfloat16)], [32]
    monkeypatch.setattr(selector, "device_name", lambda: "NVIDIA H200")
    trusted = selector.select_kernels(specs, heads, 16)
    assert trusted.decode and trusted.page_write and trusted.prefill and trusted.checks[0][1] == "trusted"
    assert not selector.select_kernels(specs, heads, 16, prefill=False).prefill  # --no-prefill-kernel
    assert not selector.select_kernels([(8, 128, 128, mx.float32)], heads, 16).prefill  # 16-bit only
    monkeypatch.setattr(selector, "device_name", lambda: "NVIDIA GeForce RTX 4090")
    other = selector.select_kernels(specs, heads, 16)
    assert not other.enabled and not other.prefill and other.reason == "decode: disagrees"


def test_the_prefill_kernel_is_checked_first_where_it_would_run(monkeypatch):
    checked = []
    monkeypatch.setattr(check, "check_prefill", lambda *args: checked.append(args) or "max |difference| 1")
    monkeypatch.setattr(check, "check_decode", lambda *args: None)
    shape = (32, 8, 128, mx.bfloat16)
    results = list(check.run_checks("cuda", [shape], 16, False, prefill_shapes=[shape]))
    assert results == [("prefill H=32 kv=8 D=128 bfloat16", False, "max |difference| 1")]
    assert checked == [(32, 8, 128, mx.bfloat16, 16, None, False)]


def test_the_check_covers_only_the_variants_the_model_runs(monkeypatch):
    """A model whose layers all use sinks is checked with sinks only (not also a no-sinks build it never runs)."""
    checked = []
    monkeypatch.setattr(check, "check_decode", lambda *args: checked.append(args[-2:]))
    shape = (4, 2, 64, mx.float16)
    names = [name for name, _, _ in check.run_checks("metal", [shape], 4, False, (None, 8), sinks=(True,))]
    assert checked == [(None, True), (8, True)] and all(name.endswith(" sinks") for name in names)


def test_checks_that_passed_here_are_kept_and_a_failure_is_not(monkeypatch, tmp_path):
    """The paged kernels' checks that passed are kept (runner/check_cache.py) under the shapes they ran, so that a
    second start decides the same plan, check for check, without running them (the runner's own check key holds
    the plan); a failed check is not kept (it runs again), and other shapes or kernel settings are another key."""
    monkeypatch.setenv("PAGEDMLX_CHECK_CACHE", "1")
    monkeypatch.setenv("PAGEDMLX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(selector, "device_name", lambda: "NVIDIA GeForce RTX 4090")
    runs, decode_err = [], [None]
    monkeypatch.setattr(check, "check_prefill", lambda *a, **k: runs.append("prefill"))
    monkeypatch.setattr(check, "check_decode", lambda *a, **k: runs.append("decode") or decode_err[0])
    monkeypatch.setattr(check, "check_page_write", lambda *a, **k: runs.append("write"))
    specs, heads = [(8, 128, 128, mx.bfloat16)], [32]
    first = selector.select_kernels(specs, heads, 16)
    ran = len(runs)
    second = selector.select_kernels(specs, heads, 16)
    assert ran >= 3 and len(runs) == ran and first == second and second.enabled and second.prefill
    monkeypatch.setitem(decode_attention.SETTINGS, "cuda",
                        dataclasses.replace(decode_attention.SETTINGS["cuda"], mma=False))  # another variant
    selector.select_kernels(specs, heads, 16)
    assert len(runs) == 2 * ran
    decode_err[0] = "disagrees"
    for _ in range(2):
        assert not selector.select_kernels(specs, heads, 32).enabled
    assert runs.count("decode") == 4  # once each: the first start, the other settings, both failing starts
