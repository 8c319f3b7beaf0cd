"""Pick a loader for a model argument: the default model, a GGUF file, a random-weight test model
(`random:<arch>`), or anything mlx_lm.load takes."""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .models.default_model import DEFAULT_MODEL, default_model_path
from .models.gguf import load_gguf
from .models.random_model import RANDOM_PREFIX, load_random


def _is_gguf(model: str) -> bool:
    return model.lower().endswith(".gguf")


def load_model(model: str | None = None) -> tuple[nn.Module, TokenizerWrapper]:
    """None: the default model; a path ending in .gguf: load_gguf; `random:<arch>`: a random-weight
    tiny model and tokenizer (pagedmlx/models/random_model.py); else mlx_lm.load (folder or hub name)."""
    if model is None:
        return load_gguf(default_model_path())
    if model.startswith(RANDOM_PREFIX):
        return load_random(model)
    if _is_gguf(model):
        return load_gguf(Path(model).expanduser())
    import mlx_lm

    try:
        loaded = mlx_lm.load(model)
    except Exception as e:  # mlx-lm and the hub raise many kinds; name the model for the user
        raise RuntimeError(f"could not load model {model!r} with mlx_lm.load: {e}") from e
    return loaded[0], loaded[1]


def model_name(model: str | None) -> str:
    """A display id: the default model's name, a GGUF file's stem, else the argument as given."""
    if model is None:
        return DEFAULT_MODEL
    if _is_gguf(model):
        return Path(model).stem
    return model.rstrip("/")
