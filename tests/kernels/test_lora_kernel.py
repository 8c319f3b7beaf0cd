"""The batched LoRA kernel (kernels/lora.py, one source for CUDA and Metal) run on the CPU in the
kernel emulator: its load-time check passes, the check fails kernels that are wrong in the ways a
kernel goes wrong, and a busy engine whose LoRA rows run through it gives every request mlx-lm's own
tokens with its adapter (greedy, float32)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from kernel_emulator import EmulatedKernel, have_compiler
from lora_utils import ADAPTER_SPECS, References, fresh, make_adapter
from test_lora import GREEDY, lora_engine, run_staggered
from utils import ARCHS, assert_no_leaks, make_prompts, fast_first

from pagedmlx.kernels import build, lora
from pagedmlx.kernels.dialect import CUDA, METAL, foreign_names, leftover_tokens
from pagedmlx.kernels.sources import lora as lora_source
from pagedmlx.lora.layers import LinearWithLoRA
from pagedmlx.lora.request import LoRARequest

pytestmark = pytest.mark.skipif(not have_compiler(), reason="g++ runs the emulated kernels")


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(build, "make_kernel", EmulatedKernel)
    lora._kernel.cache_clear()
    yield
    lora._kernel.cache_clear()


@pytest.mark.parametrize("backend", [METAL, CUDA])
@pytest.mark.parametrize("siblings", [1, 2, 3])
def test_the_source_renders_for_each_backend_and_names_nothing_of_the_other(backend, siblings):
    text = lora.add_lora_source(backend, siblings)
    assert not leftover_tokens(text) and not foreign_names(text, backend)


@pytest.mark.parametrize("backend", [METAL, CUDA])
@pytest.mark.parametrize("dtype", fast_first(1, [mx.bfloat16, mx.float32, mx.float16], unpack=False))
def test_emulated_kernel_passes_its_check(emulated, backend, dtype):
    assert lora.check_add_lora(backend, dtype) is None


@pytest.mark.parametrize("mutant", [
    ("scale * static_cast", "static_cast"),  # the adapter's scale forgotten
    ("o += 256 * VOUT", "o += 512 * VOUT"),  # every other stride of a tile never written
    ("indices[t]", "indices[GROUP_X]"),  # a row takes another row's adapter
    ("part[w * 16 + THREAD_IN_GROUP]", "part[THREAD_IN_GROUP]"),  # one warp's sums taken for the whole row's
    ("r0 += 16", "r0 += 32"),  # ranks 16-19 never computed (left unset in shared memory)
    ("(size_t)r * OUT", "(size_t)r"),  # B read along the wrong axis
])
def test_the_check_fails_a_wrong_kernel(emulated, monkeypatch, mutant):
    assert mutant[0] in lora_source.ADD_LORA
    monkeypatch.setattr(lora_source, "ADD_LORA", lora_source.ADD_LORA.replace(*mutant))
    assert lora.check_add_lora(METAL, mx.float32) is not None


@pytest.mark.parametrize("mutant", [
    ("(GROUP_X >= START2)", "(GROUP_X > START2)"),  # the third projection's first tile computed as the second's
    ("(m == 1 ? lora_b1", "(m == 1 ? lora_b0"),  # a sibling expanded with another projection's B
])
def test_the_check_fails_a_wrong_choice_of_sibling(emulated, monkeypatch, mutant):
    real = lora.lora_prelude
    assert mutant[0] in real(3)
    monkeypatch.setattr(lora, "lora_prelude", lambda n: real(n).replace(*mutant))
    assert lora.check_add_lora(CUDA, mx.float32) is not None


@pytest.mark.parametrize("max_rows,merged", fast_first(0, [(None, True), (6, False), (None, False)]))
def test_busy_engine_on_the_kernel_equals_mlx_lm_alone(emulated, monkeypatch, tmp_path, max_rows, merged):
    """Rows of three adapters and of the base model in the same steps, through chunked prefill.
    max_rows: steps of more rows run MLX's stacked products instead (lora.MAX_ROWS), the rest the kernel.
    merged: the base's projections merged (layers/merged_linear.py), the kernel reading each part in place."""
    stacked, real_stacks = [], LinearWithLoRA.used_stacks
    if max_rows is not None:
        monkeypatch.setattr(lora, "MAX_ROWS", max_rows)
        monkeypatch.setattr(LinearWithLoRA, "used_stacks",
                            lambda self, step: stacked.append(1) or real_stacks(self, step))
    base = fresh()
    adapters = [LoRARequest(f"a{i}", i + 1, make_adapter(str(tmp_path / f"a{i}"), base, **spec))
                for i, spec in enumerate(ADAPTER_SPECS) if not spec.get("dora")][:3]
    refs = References(base)
    prompts = make_prompts(8, ARCHS["llama"]["vocab_size"], seed=11)
    loras = [None if i % 4 == 3 else adapters[i % len(adapters)] for i in range(len(prompts))]
    engine = lora_engine(max_loras=3, merge_projections=merged)
    engine.runner.lora_manager.punica.kernel_backend = CUDA
    calls, in_place, real = [], [], lora.add_lora_siblings

    def spy(x, ys, *a, **k):
        calls.append(len(ys))
        in_place.append(any(k.get("y_parts") or []))
        return real(x, ys, *a, **k)

    monkeypatch.setattr(lora, "add_lora_siblings", spy)
    done = run_staggered(engine, prompts, loras, GREEDY, seed=5)
    assert set(calls) == {1, 2, 3}  # the adapters' rows ran through the kernel, siblings (q/k/v, gate/up) in one launch
    assert any(in_place) == merged  # merged parts read in place from their group's product
    assert engine.runner.lora_manager.punica.share_launches
    assert bool(stacked) == (max_rows is not None)  # and the longer steps' through MLX's products
    for i, (p, adapter) in enumerate(zip(prompts, loras)):
        refs.check(done[str(i)], adapter.lora_path if adapter else None, p, GREEDY.max_tokens, f"request {i}")
    assert_no_leaks(engine)


def test_the_selector_runs_the_kernel_only_where_its_check_passes(emulated, monkeypatch, caplog):
    from pagedmlx.kernels.selector import KernelPlan, select_lora_kernel

    assert select_lora_kernel(KernelPlan(None, reason="no GPU backend")) == (None, "no GPU backend")
    assert select_lora_kernel(KernelPlan(CUDA, reason="PAGEDMLX_CUDA_KERNELS=0")) == (None, "PAGEDMLX_CUDA_KERNELS=0")
    assert select_lora_kernel(KernelPlan(CUDA)) == (CUDA, None)
    monkeypatch.setattr(lora_source, "ADD_LORA", lora_source.ADD_LORA.replace("scale * static_cast", "static_cast"))
    lora._kernel.cache_clear()
    backend, why = select_lora_kernel(KernelPlan(CUDA))
    assert backend is None and why.startswith("its load-time check failed in float32: max relative difference")
    assert "batched LoRA kernel is off" in caplog.text


def test_siblings_share_a_launch_only_when_called_on_the_same_input(emulated, caplog):
    """Three layers called on one input in the learning step; later steps compute the second and third in
    the first's launch. Called on another input than the kept output's, a sibling computes its own output
    and the sharing stops (a warning says so): the values are each layer's own either way."""
    import mlx.nn as nn
    import numpy as np

    from pagedmlx.lora.layers import LinearWithLoRA, LoRAStep, PunicaWrapper
    from pagedmlx.lora.models import LoRALayerWeights

    mx.random.seed(0)
    punica = PunicaWrapper(CUDA)
    layers = [LinearWithLoRA(nn.Linear(32, out, bias=False), punica, 2, 4, mx.float32) for out in (32, 16, 24)]
    for i, layer in enumerate(layers):
        layer.set_lora(1, LoRALayerWeights(f"l{i}", mx.random.normal((32, 4)),
                                           mx.random.normal((4, layer.output_size))))
    indices = mx.array([1, 0, 1], mx.int32)
    step = lambda: LoRAStep(3, indices, mx.array([1], mx.int32), mx.array([1] * 4, mx.int32),  # noqa: E731
                            frozenset({1}), frozenset(), mx.array([0.0, 2.0]))
    x, other = mx.random.normal((3, 1, 32)), mx.random.normal((3, 1, 32))

    def want(layer, v):  # mlx-lm's LoRALinear for slot-1 rows, the base layer for the others
        a, b = layer._lora_a_stacked[1], layer._lora_b_stacked[1]
        lora = 2.0 * ((v @ a.T) @ b)
        return layer.base_layer(v) + lora * (indices == 1).astype(mx.float32).reshape(3, 1, 1)

    calls, real = [], lora.add_lora_siblings
    lora.add_lora_siblings = lambda x, ys, *a, **k: calls.append(len(ys)) or real(x, ys, *a, **k)
    try:
        for inputs in ([x, x, x], [x, x, x], [x, other, x]):
            punica.begin_step(step())
            got = [layer(v) for layer, v in zip(layers, inputs)]
            punica.end_step()
            for layer, v, g in zip(layers, inputs, got):
                np.testing.assert_allclose(np.array(g), np.array(want(layer, v)), rtol=1e-4, atol=1e-4)
    finally:
        lora.add_lora_siblings = real
    assert calls == [1, 1, 1, 3, 3, 1]  # learning step: one launch a layer; then one for all three
    assert not punica.share_launches and "sibling projections run one launch each" in caplog.text



def test_a_step_that_raises_neither_teaches_siblings_nor_stops_sharing(emulated, tmp_path):
    """LoRAModelManager.step: a forward pass that raises after the first of three siblings' calls."""
    import numpy as np

    from pagedmlx.lora.model_manager import StepLoRA

    engine = lora_engine(max_loras=1)
    manager = engine.runner.lora_manager
    manager.punica.kernel_backend = CUDA
    base = fresh()
    manager.add_adapter(LoRARequest("a", 1, make_adapter(str(tmp_path / "a"), base, rank=4, scale=2.0, seed=1)))
    prepared = manager.prepare_step(np.array([1]), [1])  # one request on adapter 1, one row
    assert isinstance(prepared, StepLoRA)
    attn = engine.runner.model.layers[-1].self_attn
    x = mx.random.normal((1, 1, attn.q_proj.input_size))
    dev = {k: mx.array(v) for k, v in prepared.host.items()}

    def broken_step():
        with manager.step(prepared, dev):
            attn.q_proj(x)
            raise RuntimeError("the forward pass failed")

    for _ in range(2):
        with pytest.raises(RuntimeError):
            broken_step()
    assert manager.punica.siblings is None  # nothing learned from a step that failed
    with manager.step(prepared, dev):
        [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    assert manager.punica.siblings[id(attn.q_proj)] == (attn.k_proj, attn.v_proj)
    with pytest.raises(RuntimeError):
        broken_step()  # q's launch kept k's and v's outputs, never asked for: the step failed, not the plan
    assert manager.punica.share_launches
