"""engine/kernel_prebuild.py: a first start's kernels built by a shallow copy of the model in a process of its own."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

import pytest

from pagedmlx.config import EngineConfig
from pagedmlx.engine import kernel_prebuild
from pagedmlx.engine.kernel_prebuild import shallow_overrides
from pagedmlx.loaders.random_model import build_model, tiny_tokenizer

LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=7, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512, tie_word_embeddings=False)


@pytest.fixture(autouse=True)
def prebuild_on(monkeypatch):
    monkeypatch.setenv("PAGEDMLX_PREBUILD", "1")


def test_overrides_keep_every_layer_kind_of_the_pattern():
    assert shallow_overrides(LLAMA) == {"num_hidden_layers": 4}
    assert shallow_overrides({**LLAMA, "num_hidden_layers": 4}) is None  # nothing to cut
    assert shallow_overrides({"model_type": "x"}) is None  # no layer count: not cut
    assert shallow_overrides({**LLAMA, "num_hidden_layers": 48, "sliding_window_pattern": 6}) == {
        "num_hidden_layers": 6}
    assert shallow_overrides({**LLAMA, "num_hidden_layers": 61, "first_k_dense_replace": 3}) == {
        "num_hidden_layers": 4}
    types = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]
    cut = shallow_overrides({**LLAMA, "num_hidden_layers": 12, "layer_types": types, "num_kv_shared_layers": 4})
    assert cut == {"num_hidden_layers": 6, "layer_types": types[:6], "num_kv_shared_layers": 0}
    assert shallow_overrides({**LLAMA, "num_hidden_layers": 42, "hidden_size_per_layer_input": 256}) is None
    # a vision-language config: its text model's layers, the rest of text_config kept
    text = {**LLAMA, "num_hidden_layers": 40, "full_attention_interval": 4}
    assert shallow_overrides({"model_type": "qwen3_5_moe", "text_config": text}) == {
        "text_config": {**text, "num_hidden_layers": 4}}


def _folder(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    model = build_model(LLAMA)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(LLAMA))
    tiny_tokenizer(LLAMA["vocab_size"])._tokenizer.save_pretrained(str(path))
    return path


def test_child_runs_the_engine_on_a_shallow_copy_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PAGEDMLX_CACHE_DIR", str(tmp_path / "cache"))
    folder = _folder(tmp_path / "model")
    config = EngineConfig(model=str(folder), block_size=4, max_model_len=64)
    assert kernel_prebuild.start(config) is None  # the CPU: nothing to build
    caplog.set_level("INFO", logger="pagedmlx")
    prebuild = kernel_prebuild.start(config, on_cuda=True)
    assert prebuild is not None
    prebuild.wait()
    assert prebuild.proc.returncode == 0, prebuild.log.read_text()[-3000:]
    assert "kernels prebuilt" in caplog.text
    kept = json.loads(prebuild.marker.read_text())
    assert kept["layers"] == {"num_hidden_layers": 4} and kept["tokens"] == 8  # its two first requests ran
    assert kernel_prebuild.start(config, on_cuda=True) is None  # built before: no second child
    monkeypatch.setenv("PAGEDMLX_FUSED_MOE_MIN_TOKENS", "3")  # another switch: other builds
    assert kernel_prebuild.start(config, on_cuda=True) is not None


def test_a_failing_child_leaves_the_builds_to_the_engine(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PAGEDMLX_CACHE_DIR", str(tmp_path / "cache"))
    folder = _folder(tmp_path / "model")
    (folder / "model.safetensors").write_bytes(b"not safetensors")  # the child cannot read its weights
    caplog.set_level("INFO", logger="pagedmlx")
    prebuild = kernel_prebuild.start(EngineConfig(model=str(folder)), on_cuda=True)
    prebuild.wait()
    assert prebuild.proc.returncode != 0 and not prebuild.marker.exists()
    assert "the kernels' prebuild failed" in caplog.text and str(prebuild.log) in caplog.text


def test_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDMLX_CACHE_DIR", str(tmp_path / "cache"))
    config = EngineConfig(model=str(_folder(tmp_path)))
    monkeypatch.setenv("PAGEDMLX_PREBUILD", "0")
    assert kernel_prebuild.start(config, on_cuda=True) is None
    monkeypatch.delenv("PAGEDMLX_PREBUILD")  # the default: off until timed on a GPU
    assert kernel_prebuild.start(config, on_cuda=True) is None


def test_the_engine_is_built_after_the_child_exits(tmp_path, monkeypatch):
    """EngineCore.from_config starts the child before the weights' read and builds its runner only once the child
    has exited (its builds are then on disk, and its device memory given back before the KV pool is sized)."""
    from pagedmlx.engine.core import EngineCore

    monkeypatch.setenv("PAGEDMLX_CACHE_DIR", str(tmp_path / "cache"))
    folder = _folder(tmp_path / "model")
    started, seen = [], []
    real_start = kernel_prebuild.start
    monkeypatch.setattr(kernel_prebuild, "start", lambda config: started.append(real_start(config, on_cuda=True))
                        or started[-1])
    real_make_runner = EngineCore.make_runner

    def make_runner(self, verify):
        seen.append(started[0].proc.poll())
        return real_make_runner(self, verify)

    monkeypatch.setattr(EngineCore, "make_runner", make_runner)
    engine = EngineCore.from_config(EngineConfig(model=str(folder), block_size=4, max_model_len=64))
    assert seen == [0] and started[0].marker.exists()
    assert len(engine.model.layers) == LLAMA["num_hidden_layers"]  # the engine's own model is whole


def test_the_child_stops_with_its_engine():
    """The engine core killed during its start: its child (here a sleeper watching its parent as the child does)
    exits within seconds instead of building on."""
    import subprocess
    import sys
    import time

    child = ("import os, time; from pagedmlx.engine.prebuild_child import _exit_with_parent; "
             "_exit_with_parent(os.getppid()); print('watching', flush=True); time.sleep(120)  # prebuild-orphan-test")
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; p = subprocess.Popen("
                               f"[sys.executable, '-c', {child!r}]); print(p.pid, flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    alive = lambda: subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                                   text=True).stdout.strip() not in ("", "Z")
    time.sleep(3.0)  # the child imports and starts watching
    assert alive()
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive()


def test_no_child_where_the_device_cannot_hold_both(tmp_path, monkeypatch):
    """The whole model and the child must fit in the device's free memory at once (twice the weights and the
    child's pool and activations); else the engine builds its kernels itself, as before."""
    from pagedmlx.runner import kv_budget

    monkeypatch.setenv("PAGEDMLX_CACHE_DIR", str(tmp_path / "cache"))
    folder = _folder(tmp_path / "model")
    weights = (folder / "model.safetensors").stat().st_size
    config = EngineConfig(model=str(folder))
    monkeypatch.setattr(kv_budget, "free_device_bytes", lambda on_gpu: 2 * weights + kernel_prebuild.CHILD_BYTES - 1)
    assert kernel_prebuild.start(config, on_cuda=True) is None
    monkeypatch.setattr(kv_budget, "free_device_bytes", lambda on_gpu: 2 * weights + kernel_prebuild.CHILD_BYTES)
    prebuild = kernel_prebuild.start(config, on_cuda=True)
    assert prebuild is not None
    prebuild.proc.kill()
    prebuild.proc.wait()
