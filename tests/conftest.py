"""Fixtures. Helpers live in tests/utils.py."""

from __future__ import annotations

import pytest
from utils import ARCHS


@pytest.fixture(params=list(ARCHS))
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def smollm():
    """The real default model, SmolLM2-135M-Instruct (float32 on the CPU), fetched once and cached."""
    from pagedmlx.loaders.loader import load_model

    return load_model(None)
