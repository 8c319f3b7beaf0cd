"""Load-time checks kept on disk (runner/check_cache.py): a pass is read back only for the same weights, setup,
code and versions; a model given as an object, or PAGEDMLX_CHECK_CACHE=0, always runs its check."""

from __future__ import annotations

import os

import pytest
from utils import make_model

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.runner import check_cache, selfcheck
from pagedmlx.runner import verify


@pytest.fixture
def checks(tmp_path, monkeypatch):
    """Counts the model checks that run, with the cache in a folder of this test's own."""
    monkeypatch.setenv("PAGEDMLX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDMLX_CHECK_CACHE", raising=False)
    runs = []
    real = selfcheck.check_paged_forward

    def counted(runner, *args, **kwargs):
        runs.append(runner)
        return real(runner, *args, **kwargs)

    monkeypatch.setattr(verify, "check_paged_forward", counted)
    return runs


def test_a_pass_is_read_back_for_the_same_model_and_setup_only(checks):
    LLMEngine.from_config(EngineConfig(model="random:llama-tiny"))
    LLMEngine.from_config(EngineConfig(model="random:llama-tiny"))
    assert len(checks) == 1
    LLMEngine.from_config(EngineConfig(model="random:llama-tiny", block_size=8))  # another setup
    LLMEngine.from_config(EngineConfig(model="random:llama-tiny", dtype="float16"))  # other weights
    assert len(checks) == 3


def test_a_model_object_or_the_switch_off_always_checks(checks, monkeypatch):
    LLMEngine(make_model("llama"), None, EngineConfig())
    LLMEngine(make_model("llama"), None, EngineConfig())
    assert len(checks) == 2
    monkeypatch.setenv("PAGEDMLX_CHECK_CACHE", "0")
    LLMEngine.from_config(EngineConfig(model="random:llama-tiny"))
    LLMEngine.from_config(EngineConfig(model="random:llama-tiny"))
    assert len(checks) == 4


def test_a_file_backed_model_is_named_by_its_files(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"one")
    first = check_cache.model_identity(str(weights), None, weights)
    assert first == check_cache.model_identity(str(weights), None, weights)
    os.utime(weights, ns=(1, 1))
    assert check_cache.model_identity(str(weights), None, weights) != first
    assert check_cache.model_identity("no/such/folder", None) is None
    assert check_cache.model_identity("preset:llama-8b", "bfloat16") == "preset:llama-8b|bfloat16"


def test_a_compiled_traces_proof_is_kept_with_the_model_check(checks, monkeypatch):
    from pagedmlx.runner.model import ModelRunner
    from pagedmlx.sampling_params import SamplingParams

    proofs = []
    real = ModelRunner._prove_trace

    def counted(self, *args):
        proofs.append(self.compiled_decode.last_key)
        return real(self, *args)

    monkeypatch.setattr(ModelRunner, "_prove_trace", counted)

    def run(**kw):
        engine = LLMEngine.from_config(EngineConfig(model="random:llama-tiny", compile_decode=True, **kw))
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()

    run()
    assert len(proofs) == 1  # one decode key
    run()  # a second start: the same trace's proof passed here before
    assert len(proofs) == 1
    monkeypatch.setenv("PAGEDMLX_CHECK_CACHE", "0")
    run()
    assert len(proofs) == 2


def test_the_model_checks_key_names_which_steps_take_the_fused_moe(monkeypatch):
    runner = LLMEngine(make_model("llama"), None, EngineConfig(num_blocks=64)).runner
    plain = check_cache.runner_check_key(runner, "weights")
    assert plain is not None
    monkeypatch.setenv("PAGEDMLX_FUSED_MOE_MIN_TOKENS", "1")
    assert check_cache.runner_check_key(runner, "weights") == plain  # no fused MoE here: the setting is not the key's
    runner.fused_moe = 4
    one = check_cache.runner_check_key(runner, "weights")
    monkeypatch.setenv("PAGEDMLX_FUSED_MOE_MIN_TOKENS", "8")
    assert one not in (plain, check_cache.runner_check_key(runner, "weights"))
