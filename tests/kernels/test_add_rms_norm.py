"""The fused residual add + RMSNorm (kernels/add_rms_norm.py, one source for CUDA and Metal) run on the CPU
in the kernel emulator: its load-time check passes against MLX's add and mx.fast.rms_norm, and fails kernels
that are wrong in the ways a kernel goes wrong; layers fused through it (layers/fused_residual.py) give a
busy engine mlx-lm's own tokens, and layers that are not the plain pre-norm pattern are left alone."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from kernel_emulator import EmulatedKernel, have_compiler
from utils import assert_no_leaks, assert_solo_greedy, make_model, run_staggered, shared_prefix_prompts, fast_first

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.kernels import add_rms_norm, build
from pagedmlx.kernels.dialect import CUDA, METAL, foreign_names, leftover_tokens
from pagedmlx.kernels.sources import add_rms_norm as norm_source
from pagedmlx.layers import fused_residual
from pagedmlx.runner.kernel_paths import kernel_path_lines
from pagedmlx.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not have_compiler(), reason="g++ runs the emulated kernels")


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(build, "make_kernel", EmulatedKernel)
    add_rms_norm._kernel.cache_clear()
    yield
    add_rms_norm._kernel.cache_clear()


@pytest.mark.parametrize("backend", [METAL, CUDA])
def test_the_source_renders_for_each_backend_and_names_nothing_of_the_other(backend):
    text = add_rms_norm.add_rms_norm_source(backend)
    assert not leftover_tokens(text) and not foreign_names(text, backend)


@pytest.mark.parametrize("backend", [METAL, CUDA])
@pytest.mark.parametrize("dtype", fast_first(1, [mx.bfloat16, mx.float32, mx.float16], unpack=False))
def test_emulated_kernel_passes_its_check(emulated, backend, dtype):
    assert add_rms_norm.check_add_rms_norm(backend, dtype, dims=(64, 576, 1000)) is None


@pytest.mark.parametrize("original,wrong,message", [
    ("static_cast<float>(x[row + d]) + static_cast<float>(r[row + d])", "static_cast<float>(x[row + d])",
     "the sum differs"),  # the residual dropped
    ("total / D", "total / (D - 1)", "max relative difference"),  # the mean over one channel too few
    ("k < 8; ++k) total", "k < 4; ++k) total", "max relative difference"),  # half the warps' sums
    ("static_cast<float>(w[d]) * ", "", "max relative difference"),  # the weight forgotten
])
def test_the_check_fails_a_wrong_kernel(emulated, monkeypatch, original, wrong, message):
    assert original in norm_source.ADD_RMS_NORM
    monkeypatch.setattr(norm_source, "ADD_RMS_NORM", norm_source.ADD_RMS_NORM.replace(original, wrong))
    err = add_rms_norm.check_add_rms_norm(CUDA, mx.float32, dims=(576,))
    assert err is not None and message in err


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _fused_engine(arch: str, monkeypatch) -> tuple:
    """A busy-schedule engine whose residual adds run through the emulated kernel (as on CUDA), and the
    number of launches it made."""
    model = make_model(arch, seed=11)  # a model of its own: its layers' classes are swapped for good
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=128, max_num_seqs=4, max_model_len=512,
                                                 compile_decode=False))  # the emulator evaluates: no traces
    runner = engine.runner
    assert not runner.fused_norms  # no GPU here: nothing fused at load
    assert fused_residual.fuse_residual_norms(model, runner._body, CUDA) is None
    runner.fused_norms = True
    assert "residual adds: fused with the RMSNorms" in "\n".join(kernel_path_lines(runner))  # the start-up lines
    launches, real = [], add_rms_norm.add_rms_norm
    monkeypatch.setattr(add_rms_norm, "add_rms_norm", lambda *a, **k: launches.append(1) or real(*a, **k))
    return model, engine, launches


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_busy_engine_with_fused_residuals_equals_mlx_lm_alone(emulated, monkeypatch, arch):
    """Every request's tokens equal mlx-lm's generation alone on the same model object, which the swapped
    layers leave as it was outside fused_residuals() (greedy, float32); the kernel ran twice a layer a step."""
    model, engine, launches = _fused_engine(arch, monkeypatch)
    prompts = [[t % engine.vocab_size for t in p] for p in shared_prefix_prompts(6, seed=3)]
    done = run_staggered(engine, prompts, GREEDY, seed=2)
    layers = len(engine.runner._body.layers)
    assert launches and len(launches) % (2 * layers) == 0
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, GREEDY.max_tokens, f"request {i}")
    assert_no_leaks(engine)


def test_a_layer_that_adds_more_than_the_plain_residual_fails_the_probe(emulated):
    """A layer that scales its attention's output before the add would be computed wrongly by the fused
    call: the probe against the body's own output refuses it, and the layers keep their own classes."""
    model = make_model("llama", seed=12)  # a model of its own (its layers' classes change)
    body = model.model
    block = type(body.layers[0])

    class Scaled(block):
        def __call__(self, x, mask=None, cache=None):
            h = x + 0.5 * self.self_attn(self.input_layernorm(x), mask, cache)
            return h + self.mlp(self.post_attention_layernorm(h))

    for layer in body.layers:
        layer.__class__ = Scaled
    why = fused_residual.fuse_residual_norms(model, body, CUDA)
    assert why is not None and "differs from the model's own" in why
    assert all(type(layer) is Scaled for layer in body.layers) and type(body.norm) is nn.RMSNorm


def test_layers_without_plain_rms_norms_are_not_fused():
    """Gemma 3 uses its own RMSNorm (1 + weight) and four norms a layer: not the pattern, left as it is."""
    model = make_model("gemma3-tiny", seed=13)  # a model of its own: its final norm is replaced below
    classes = [type(m) for m in [*model.model.layers, model.model.norm]]
    why = fused_residual.fuse_residual_norms(model, model.model, CUDA)
    assert why == "no nn.RMSNorm final norm"
    model.model.norm = nn.RMSNorm(model.model.norm.weight.shape[0])  # a plain final norm: the layers still differ
    assert "is not a pre-norm block" in fused_residual.fuse_residual_norms(model, model.model, CUDA)
    assert [type(m) for m in model.model.layers] == classes[:-1]


def test_a_second_runner_on_the_same_model_fuses_it_too_and_a_failed_probe_keeps_the_first(emulated, monkeypatch):
    """Benchmarks and draft models run several engines on one model object: a second fuse finds the layers
    already swapped, fuses as well and wraps nothing twice; a probe that fails undoes only its own swaps."""
    model = make_model("llama", seed=14)
    body = model.model
    assert fused_residual.fuse_residual_norms(model, body, CUDA) is None
    classes = [type(m) for m in [*body.layers, body.norm]]
    assert fused_residual.fuse_residual_norms(model, body, CUDA) is None
    assert ([type(m) for m in [*body.layers, body.norm]] == classes
            and all(c.__name__.startswith("Fused") for c in classes))
    monkeypatch.setattr(fused_residual, "_probe", lambda model, body: "a probe that fails")
    assert fused_residual.fuse_residual_norms(model, body, CUDA) == "a probe that fails"
    assert [type(m) for m in [*body.layers, body.norm]] == classes  # the first runner's swaps stand


def test_asked_for_where_no_kernel_runs_the_engine_says_why_and_runs_unfused(caplog):
    """Off by default; asked for on the CPU (no GPU backend), a warning names the reason and nothing is swapped."""
    model = make_model("llama", seed=15)
    assert not LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=32)).runner.fused_norms
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=32, fuse_norms=True))
    assert not engine.runner.fused_norms and "residual adds not fused with their norms: no GPU backend" in caplog.text
    assert not any(type(m).__name__.startswith("Fused") for m in [*model.model.layers, model.model.norm])
