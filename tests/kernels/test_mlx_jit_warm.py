"""MLX's tiled quantized matmul built ahead on a first start (kernels/mlx_jit_warm.py): one worker process per
format and row tile whose module is not on disk, none elsewhere, and a worker that runs its product and exits."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
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
    def __init__(self, argv, **kwargs):
        self.argv, self.waited = argv, False
        LAUNCHED.append(self)

    def wait(self, timeout=None):
        self.waited = True
        return 0


LAUNCHED: list[FakeProcess] = []


def test_formats_are_the_models_quantized_layers():
    assert mlx_jit_warm.formats(_mixed_model()) == {BF16_4, BF16_8}
    assert mlx_jit_warm.formats(make_model("llama")) == set()  # float weights: nothing of qmm's


def test_a_worker_per_format_and_tile_not_on_disk_and_none_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setattr(mlx_jit_warm.subprocess, "Popen", FakeProcess)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    LAUNCHED.clear()
    model = _mixed_model()
    assert mlx_jit_warm.start(model) == 0 and not LAUNCHED  # not CUDA: MLX builds nothing of the kind
    monkeypatch.setattr(build, "gpu_backend", lambda: CUDA)
    monkeypatch.setattr(mx, "device_info", lambda: {"compute_capability_major": 9, "compute_capability_minor": 0})
    (tmp_path / (mlx_jit_warm.module_name(BF16_4, 32) + ".ptx")).write_bytes(b"\x7fELF")  # built before
    assert mlx_jit_warm.start(model) == 5
    args = sorted(tuple(p.argv[3:]) for p in LAUNCHED)
    assert args == sorted([("bfloat16", "4", "64", "affine", "16"), ("bfloat16", "4", "64", "affine", "64")]
                          + [("bfloat16", "8", "64", "affine", str(t)) for t in mlx_jit_warm.TILES])
    assert all(p.argv[:3] == [sys.executable, "-m", "pagedmlx.kernels.mlx_jit_warm"] for p in LAUNCHED)
    mlx_jit_warm.wait()
    assert all(p.waited for p in LAUNCHED) and not mlx_jit_warm._running
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    LAUNCHED.clear()
    assert mlx_jit_warm.start(model) == 0 and not LAUNCHED  # no folder MLX keeps modules in: nothing to build ahead


def test_a_worker_runs_its_product_and_exits():
    done = subprocess.run([sys.executable, "-m", "pagedmlx.kernels.mlx_jit_warm", "bfloat16", "4", "64", "affine",
                           "16"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
