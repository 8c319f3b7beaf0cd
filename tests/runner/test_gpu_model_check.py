"""On a GPU (skipped elsewhere): every family the tests serve passes the load-time check with the kernels
the selector picks, so no family decodes on the gather path for a disagreement. A family whose head
shapes no kernel takes may still gather (its reason says so), but never "disagrees". Float32 with TF32
off, as the GPU suite runs the busy == solo tests (scripts/gpu/gpu_suite.sh); bfloat16 too, with the
check's own dtype tolerance. scripts/gpu/check_families.py prints which kernel a failure comes from."""

from __future__ import annotations

import mlx.core as mx
import pytest

from pagedmlx.config import EngineConfig
from pagedmlx.kernels import build
from pagedmlx.loaders.random_model import RANDOM_ARCHS, build_model
from pagedmlx.runner.model import ModelRunner
from scripts.gpu.check_families import EXTRA, FAMILIES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(build.gpu_backend() is None, reason="a GPU runs the kernels")]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", FAMILIES + list(EXTRA))
def test_the_selected_kernels_pass_the_model_check(arch, dtype):
    model = build_model(EXTRA.get(arch) or RANDOM_ARCHS[arch])
    model.set_dtype(dtype)
    runner = ModelRunner(model, EngineConfig(block_size=16, num_blocks=64))
    assert "disagrees" not in (runner.kernels.reason or ""), runner.kernels.reason
