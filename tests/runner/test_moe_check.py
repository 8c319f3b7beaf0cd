"""The load-time check on MoE models (runner/routing.py): where two experts tie, rounding on pages may pick the
other one, and the check must still pass that model; a model whose pages compute a wrong expert product or route
to experts no tie explains must still be refused, by its reason. A 4-bit Qwen3.6-style MoE (qwen3_5_moe) whose
routers have duplicate rows: experts 0 and 1 tie exactly in every layer; and a bf16 4-bit one with 64 experts, top-8,
on an emulated backend whose products round by row count (as MLX's CUDA kernels do), where the router values drift
past the fixed bound: it passes, and faults on it are still refused."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from utils import assert_no_leaks, assert_solo_greedy, run_staggered, shared_prefix_prompts

from pagedmlx.bench.presets import Quantization, quantize_model
from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.loaders.random_model import RANDOM_ARCHS, build_model
from pagedmlx.runner import selfcheck
from pagedmlx.runner.model import ModelRunner
from pagedmlx.runner.plan import UnsupportedModelError
from pagedmlx.runner.routing import routing_match
from pagedmlx.runner.thread_flag import ThreadFlag
from pagedmlx.sampling_params import SamplingParams

CONFIG = EngineConfig(block_size=4, num_blocks=64)
on_pages = ThreadFlag()  # set while the runner computes a paged step (ModelRunner.logits), for the faults below


def tied_moe(experts: int = 8, top_k: int = 2) -> nn.Module:
    """qwen3_5_moe-tiny with more experts, 4-bit (routers 8-bit, as mlx-lm's convert does), experts 0 and 1 tied."""
    text = dict(RANDOM_ARCHS["qwen3_5_moe-tiny"]["text_config"], num_experts=experts, num_experts_per_tok=top_k)
    model = build_model(dict(RANDOM_ARCHS["qwen3_5_moe-tiny"], text_config=text))
    quantize_model(model, Quantization(4, group_size=32))
    for layer in model.language_model.model.layers:
        gate = layer.mlp.gate
        for name in ("weight", "scales", "biases"):
            w = getattr(gate, name)
            setattr(gate, name, mx.concatenate([w[:1], w[:1], w[2:]]))
    mx.eval(model.parameters())
    return model


class PagedOnly(nn.Module):
    """Wraps a module; on paged steps only, its output goes through `change`."""

    def __init__(self, inner: nn.Module, change):
        super().__init__()
        self.inner, self.change = inner, change

    def __call__(self, *args):
        out = self.inner(*args)
        return self.change(out, *args) if on_pages.on else out


@pytest.fixture
def paged_flag(monkeypatch):
    real = ModelRunner.logits

    def logits(self, *args, **kwargs):
        with on_pages.scope():
            return real(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "logits", logits)


def wrap_layers(model: nn.Module, attr: str, change, layers=None) -> None:
    for i, layer in enumerate(model.language_model.model.layers):
        if layers is None or i in layers:
            setattr(layer.mlp, attr, PagedOnly(getattr(layer.mlp, attr), change))


def nudge_tie(logits: mx.array, x: mx.array) -> mx.array:
    """Expert 1's router logit a rounding step below expert 0's, its twin: another kernel's last bit (mlx-lm's own
    argpartition keeps expert 1 where only one of the two is taken)."""
    return logits + mx.array([0.0, -1e-6] + [0.0] * (logits.shape[-1] - 2)) * mx.abs(logits[..., :1])


def recorded(monkeypatch) -> list:
    """The check's RoutingMatch objects, as it makes them."""
    seen = []

    class Keep:
        def __enter__(self):
            self.ctx = routing_match()
            seen.append(self.ctx.__enter__())
            return seen[-1]

        def __exit__(self, *exc):
            return self.ctx.__exit__(*exc)

    monkeypatch.setattr(selfcheck, "routing_match", Keep)
    return seen


def test_a_tie_broken_the_other_way_on_pages_passes(monkeypatch, paged_flag):
    """Pages break the tie the other way (expert 0 by a last bit): each side's own routing then differs at the
    tie, and the reference follows the paged choice; the logits agree as closely as a dense model's."""
    model = tied_moe()
    wrap_layers(model, "gate", nudge_tie)
    seen, errors = recorded(monkeypatch), {}
    assert selfcheck.check_paged_forward(ModelRunner(model, CONFIG, verify=False), errors) is None
    assert seen[0].forced > 0  # the tie did go the other way on pages
    assert seen[0].worst.ratio < 1e-5
    assert max(errors.values()) < 1e-4, errors
    ModelRunner(model, CONFIG)  # and the runner starts


def test_without_the_match_the_same_tie_is_refused(monkeypatch, paged_flag):
    """The negative control of the test above: each side routing on its own, the broken tie alone moves
    the logits past the tolerance."""
    model = tied_moe()
    wrap_layers(model, "gate", nudge_tie)

    class Unmatched:
        def __enter__(self):
            from contextlib import nullcontext

            from pagedmlx.runner.routing import RoutingMatch
            match = RoutingMatch()
            match.record = match.follow = lambda rows, noise=False: nullcontext()
            return match

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(selfcheck, "routing_match", Unmatched)
    with pytest.raises(UnsupportedModelError, match="max relative logit difference"):
        ModelRunner(model, CONFIG)


def test_a_wrong_expert_product_on_pages_is_refused(paged_flag):
    """Expert 3's output 10% too large in one layer, on pages only: routing agrees, the next layers' router values
    and the logits do not."""
    model = tied_moe()

    def wrong(y: mx.array, x: mx.array, inds: mx.array) -> mx.array:
        return mx.where((inds == 3)[..., None], 1.1 * y, y)

    wrap_layers(model, "switch_mlp", wrong, layers={1})
    with pytest.raises(UnsupportedModelError, match="max relative logit difference|router values differ"):
        ModelRunner(model, CONFIG)


def test_routing_to_other_experts_than_a_tie_explains_is_refused(paged_flag):
    """Pages route by a router whose last expert is far ahead of its value in mlx-lm: refused as a routing
    fault, by name, not passed as a tie."""
    model = tied_moe()

    def skewed(logits: mx.array, x: mx.array) -> mx.array:
        return logits + mx.array([0.0] * (logits.shape[-1] - 1) + [50.0])

    wrap_layers(model, "gate", skewed, layers={2})
    with pytest.raises(UnsupportedModelError, match="routes to other experts than mlx-lm"):
        ModelRunner(model, CONFIG)


def test_busy_engine_equals_solo_with_tied_experts():
    model = tied_moe()
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=80, max_num_batched_tokens=64,
                                                 long_prefill_token_threshold=40, max_num_seqs=12,
                                                 state_checkpoint_interval=8))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = shared_prefix_prompts(12, seed=7)
    done = run_staggered(engine, prompts, params, seed=3)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, params.max_tokens, f"request {i} ({len(p)} tokens)")
    assert_no_leaks(engine)


def bf16_moe(experts: int = 64, top_k: int = 8, layers: int = 8) -> nn.Module:
    """qwen3_5_moe-tiny in bf16 with many experts and layers, 4-bit (routers 8-bit)."""
    text = dict(RANDOM_ARCHS["qwen3_5_moe-tiny"]["text_config"], num_experts=experts, num_experts_per_tok=top_k,
                num_hidden_layers=layers)
    model = build_model(dict(RANDOM_ARCHS["qwen3_5_moe-tiny"], text_config=text))
    model.set_dtype(mx.bfloat16)
    quantize_model(model, Quantization(4, group_size=32))
    mx.eval(model.parameters())
    return model


@pytest.fixture
def kernels_by_row_count(monkeypatch):
    """A backend like MLX's CUDA one: a quantized product of one row runs another kernel than one of several,
    which rounds otherwise (here: several rows in float32, rounded once). Pages multiply the step's rows at once,
    mlx-lm a decode's one row: both right, and the router values drift apart by more than the fixed bound."""
    real = mx.quantized_matmul

    def product(x, *args, **kwargs):
        if x.dtype != mx.bfloat16 or x.ndim < 2 or x.shape[-2] == 1:
            return real(x, *args, **kwargs)
        up = [a.astype(mx.float32) if isinstance(a, mx.array) and a.dtype == mx.bfloat16 else a for a in args]
        return real(x.astype(mx.float32), *up, **kwargs).astype(x.dtype)

    monkeypatch.setattr(mx, "quantized_matmul", product)


def test_bf16_routers_drifting_with_the_kernels_pass(monkeypatch, kernels_by_row_count):
    """The drift is past the fixed bound (6e-2 of the logits' and router values' scale), and within how far
    mlx-lm's own values move when it runs the paged step's row count: the model starts."""
    seen, errors = recorded(monkeypatch), {}
    assert selfcheck.check_paged_forward(ModelRunner(bf16_moe(), CONFIG, verify=False), errors) is None
    tol = selfcheck.LOGIT_TOLERANCE[mx.bfloat16]
    assert max(errors.values()) > tol and seen[0].drift.ratio > tol, (errors, seen[0].drift)


def router_fault(change) -> str:
    model = bf16_moe()
    wrap_layers(model, "gate", lambda logits, x: change(logits), layers={2})
    return selfcheck.check_paged_forward(ModelRunner(model, CONFIG, verify=False)) or ""


def test_bf16_routing_to_other_experts_is_refused_through_the_drift(kernels_by_row_count, paged_flag):
    """The last expert's router logit one higher on pages, in one layer: another choice, refused by name."""
    assert "routes to other experts than mlx-lm" in router_fault(
        lambda logits: logits + mx.array([0.0] * (logits.shape[-1] - 1) + [1.0], logits.dtype))


def test_bf16_wrong_router_values_are_refused_through_the_drift(kernels_by_row_count, paged_flag):
    """Router logits 20% too sharp on pages, in one layer: the forced choice cannot hide them."""
    why = router_fault(lambda logits: logits * 1.2)
    assert "router values differ from mlx-lm's" in why or "routes to other experts" in why, why


def test_bf16_wrong_expert_product_is_refused_through_the_drift(kernels_by_row_count, paged_flag):
    """Expert 3's output 10% too large in one layer, on pages only: the next layers' router values or the logits
    show it."""
    model = bf16_moe()
    wrap_layers(model, "switch_mlp", lambda y, x, inds: mx.where((inds == 3)[..., None], 1.1 * y, y), layers={1})
    why = selfcheck.check_paged_forward(ModelRunner(model, CONFIG, verify=False)) or ""
    assert "max relative logit difference" in why or "router values differ from mlx-lm's" in why, why
