"""MLX's tiled quantized matmul built ahead on a first start (kernels/mlx_jit_warm.py): one worker process per
format and row tile whose module is not on disk, none elsewhere, and a worker that runs its product and exits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from utils import make_model

from pagedmlx.kernels import build, mlx_jit_warm
from pagedmlx.kernels.dialect import CUDA

BF16_4, BF16_8 = ("bfloat16", 4, 64, "affine"), ("bfloat16", 8, 64, "affine")


def _mixed_model():
    """bf16, 4-bit body, 8-bit head (a mixed-precision conversion, as mlx-lm writes with a quant predicate)."""
    model = make_model.__wrapped__("llama")  # a model of its own (make_model's are shared)
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, 64, 4, class_predicate=lambda p, m: isinstance(m, nn.Linear) and "lm_head" not in p)
    nn.quantize(model, 64, 8, class_predicate=lambda p, m: isinstance(m, (nn.Linear, nn.Embedding)))
    return model


class FakeProcess:
    """A worker that "builds" its module into its folder: under the expected name, another, or dies."""

    def __init__(self, argv, env, **kwargs):
        self.argv, self.folder, self.killed = argv, Path(env["MLX_PTX_CACHE_DIR"]), False
        LAUNCHED.append(self)

    def wait(self, timeout=None):
        fmt, tile = (self.argv[3], int(self.argv[4]), int(self.argv[5]), self.argv[6]), int(self.argv[7])
        name = mlx_jit_warm.module_name(fmt, tile) if BUILDS == "expected" else f"qmm_other_{fmt[1]}_{tile}"
        if not self.killed:
            (self.folder / f"{name}.txt").write_text("names")
            (self.folder / f"{name}.ptx").write_bytes(b"\x7fELF")
        return -9 if self.killed else 0

    def kill(self):
        self.killed = True


LAUNCHED: list[FakeProcess] = []
BUILDS = "expected"


def test_formats_are_the_models_quantized_layers():
    assert mlx_jit_warm.formats(_mixed_model()) == {BF16_4, BF16_8}
    assert mlx_jit_warm.formats(make_model("llama")) == set()  # float weights: nothing of qmm's


@pytest.fixture
def on_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(mlx_jit_warm.subprocess, "Popen", FakeProcess)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "gpu_backend", lambda: CUDA)
    monkeypatch.setattr(mx, "device_info", lambda: {"compute_capability_major": 9, "compute_capability_minor": 0})
    monkeypatch.setattr(sys.modules[__name__], "BUILDS", "expected")
    LAUNCHED.clear()
    return tmp_path


def test_a_worker_per_format_and_tile_not_on_disk_its_module_moved_into_the_cache(on_cuda, monkeypatch):
    model = _mixed_model()
    (on_cuda / (mlx_jit_warm.module_name(BF16_4, 32) + ".ptx")).write_bytes(b"\x7fELF")  # built before
    (on_cuda / (mlx_jit_warm.module_name(BF16_4, 32) + ".txt")).write_text("names")
    with mlx_jit_warm.building(model) as started:
        assert started == 5 and all(not list(p.folder.iterdir()) for p in LAUNCHED)
    args = sorted(tuple(p.argv[3:]) for p in LAUNCHED)
    assert args == sorted([("bfloat16", "4", "64", "affine", "16"), ("bfloat16", "4", "64", "affine", "64")]
                          + [("bfloat16", "8", "64", "affine", str(t)) for t in mlx_jit_warm.TILES])
    assert all(p.argv[:3] == [sys.executable, "-m", "pagedmlx.kernels.mlx_jit_warm"] for p in LAUNCHED)
    modules = sorted(p.stem for p in on_cuda.glob("*.ptx"))
    assert modules == sorted(mlx_jit_warm.module_name(f, t) for f in (BF16_4, BF16_8) for t in mlx_jit_warm.TILES)
    assert all((on_cuda / f"{m}.txt").exists() for m in modules) and [p.name for p in on_cuda.iterdir()
                                                                       if p.is_dir()] == []  # workers' folders gone
    LAUNCHED.clear()
    with mlx_jit_warm.building(model) as started:  # all on disk now: nothing to build
        assert started == 0 and not LAUNCHED


def test_nothing_is_built_off_cuda_or_without_a_cache_folder(on_cuda, monkeypatch):
    model = _mixed_model()
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    with mlx_jit_warm.building(model) as started:
        assert started == 0
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(on_cuda))
    monkeypatch.setattr(build, "gpu_backend", lambda: None)
    with mlx_jit_warm.building(model) as started:
        assert started == 0
    assert not LAUNCHED and not list(on_cuda.iterdir())


def test_a_failed_start_stops_its_workers_and_keeps_nothing(on_cuda):
    with pytest.raises(RuntimeError, match="refused"):
        with mlx_jit_warm.building(_mixed_model()):
            raise RuntimeError("model refused")
    assert LAUNCHED and all(p.killed for p in LAUNCHED) and not list(on_cuda.glob("*.ptx"))


def test_an_mlx_that_names_its_modules_otherwise_is_left_alone_after_once(on_cuda, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "BUILDS", "other")
    model = _mixed_model()
    with mlx_jit_warm.building(model) as started:
        assert started == 6
    assert (on_cuda / mlx_jit_warm.NAMES_DIFFER).exists()
    assert len(list(on_cuda.glob("qmm_other_*.ptx"))) == 6  # what it built is still MLX's own, kept
    LAUNCHED.clear()
    with mlx_jit_warm.building(model) as started:
        assert started == 0 and not LAUNCHED


def test_a_worker_runs_its_product_and_exits():
    done = subprocess.run([sys.executable, "-m", "pagedmlx.kernels.mlx_jit_warm", "bfloat16", "4", "64", "affine",
                           "16"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
