"""The runner projects only sampled rows to the vocabulary (its split head), for the families whose
head is more than a plain matmul (Gemma 4's soft-capping, Qwen3.5's multimodal wrapper, LFM2's tied
head without a flag); and at load a split head that disagrees is dropped before any kernel is blamed."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from utils import make_model

from pagedmlx.config import EngineConfig
from pagedmlx.kernels.selector import KernelPlan
from pagedmlx.runner import verify
from pagedmlx.runner.model import ModelRunner


@pytest.mark.parametrize("arch", ["llama", "gemma3-tiny", "gemma4-e-tiny", "gemma4-moe-tiny", "qwen3_5-tiny",
                                  "qwen3_5_moe-tiny", "lfm2-tiny"])
def test_the_head_is_split_and_verified(arch):
    runner = ModelRunner(make_model(arch), EngineConfig(block_size=4, num_blocks=64))
    assert runner._head is not None


def test_a_head_that_is_not_plain_runs_whole():
    """Cohere 2 scales its logits after the tied head: the check refutes the split, the model runs whole."""
    runner = ModelRunner(make_model("cohere2-tiny"), EngineConfig(block_size=4, num_blocks=64))
    assert runner._head is None


def _faulty(runner: ModelRunner, fault: str):
    """A check that fails while the split head runs ("head") or while the decode kernel runs ("kernel")."""
    def check():
        if fault == "head" and runner._head is not None:
            return "head disagrees"
        if fault == "kernel" and runner.kernels.decode:
            return "kernel disagrees"
        return None
    return check


@pytest.mark.parametrize("fault", ["head", "kernel"])
def test_verification_blames_the_part_that_disagrees(fault, caplog, monkeypatch):
    runner = ModelRunner(make_model("gemma4-e-tiny"), EngineConfig(block_size=4, num_blocks=64), verify=False)
    runner.kernels = dataclasses.replace(KernelPlan("cuda"), decode=True)
    monkeypatch.setattr(verify, "check_paged_forward", lambda r, check=_faulty(runner, fault): check())
    runner._verify_against_mlx_lm()
    if fault == "head":
        assert runner.kernels.decode and runner.kernels.reason is None and runner._head is None
        assert "kernels off" not in caplog.text
    else:
        assert not runner.kernels.decode and "kernel disagrees" in runner.kernels.reason
        assert runner._head is not None


def test_soft_capping_joins_the_head():
    model = make_model("gemma4-e-tiny")
    runner = ModelRunner(model, EngineConfig(block_size=4, num_blocks=64), verify=False)
    h = mx.random.normal((3, 1, model.args.hidden_size)) * 50
    want = mx.tanh(model.model.embed_tokens.as_linear(h) / 30.0) * 30.0
    assert mx.array_equal(runner._head(h), want) and mx.abs(want).max().item() <= 30.0
