"""Fixtures. Helpers live in tests/utils.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from utils import ARCHS

# tests/ mirrors the package; test modules of one folder import helpers from another's (`from test_kv_quant
# import ...`), so every folder is importable by module name, as in one flat folder.
# Every test runs the load-time model check: a pass kept by an earlier test would hide a fault a test injects
# (tests/runner/test_check_cache.py turns the cache on for itself).
os.environ["PAGEDMLX_CHECK_CACHE"] = "0"

sys.path += [str(d) for d in sorted(Path(__file__).parent.iterdir()) if d.is_dir() and any(d.glob("test_*.py"))]


@pytest.fixture(params=list(ARCHS))
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def smollm():
    """The real default model, SmolLM2-135M-Instruct (float32 on the CPU), fetched once and cached."""
    from pagedmlx.loaders.loader import load_model

    return load_model(None)
