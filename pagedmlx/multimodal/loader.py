"""Vision-language models: the language model runs on pages through mlx-lm's class for the model type, the vision
tower and projector come from mlx-vlm's model; both hold the same weight arrays (never loaded twice)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from pagedmlx.multimodal.families import vision_encoder
from pagedmlx.multimodal.models import UnsupportedMultiModalError, VisionEncoder

logger = logging.getLogger("pagedmlx")


class RefusedVision(VisionEncoder):
    """A vision-language model served text-only: every request with images gets `reason`."""

    def __init__(self, model_type: str, reason: str, image_token_id: int = -1):
        self.model_type, self.reason, self.image_token_id = model_type, reason, image_token_id

    def encode(self, feature, dtype):
        raise UnsupportedMultiModalError(self.reason)


def is_vlm(model: Any) -> bool:
    """An mlx-vlm model object (a vision tower beside its language model)."""
    return isinstance(model, nn.Module) and "vision_tower" in model and "language_model" in model


def build_vlm(config: dict, seed: int = 0, scale: float = 2.0) -> nn.Module:
    """A random-weight float32 mlx-vlm model from a config dict (text_config and vision_config inside), seeded;
    weights scaled as loaders/random_model.py's (decisive logits). Projections that mlx-vlm initialises to ones
    (Gemma 3's mm_input_projection_weight) are drawn at random: all-ones would give every image row one value."""
    from mlx.utils import tree_map_with_path
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    arch, _ = get_model_and_args(config)
    model_config = arch.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, arch, config, ["text", "vision", "audio"])
    mx.random.seed(seed)
    model = arch.Model(model_config)
    def init(path: str, p: mx.array) -> mx.array:
        if path.endswith("projection_weight"):
            return mx.random.normal(p.shape) * p.shape[0] ** -0.5
        return p * scale

    model.update(tree_map_with_path(init, model.parameters()))
    mx.eval(model.parameters())
    return model


def split_vlm(vlm: nn.Module) -> tuple[nn.Module, VisionEncoder]:
    """(mlx-lm text model, vision encoder) of an in-process mlx-vlm model; the text model's parameters are the
    mlx-vlm language model's arrays themselves. A family whose images cannot be served exactly gets a RefusedVision
    (its text model still serves)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = vlm.config
    text_config = config.text_config
    text = dataclasses.asdict(text_config) if dataclasses.is_dataclass(text_config) else dict(text_config)
    cfg = {"model_type": config.model_type, "text_config": text, "vocab_size": text["vocab_size"]}
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    weights = [(f"language_model.{k}", v) for k, v in tree_flatten(vlm.language_model.parameters())]
    model.load_weights(weights, strict=True)
    return model, encoder_or_refusal(vlm)


def encoder_or_refusal(vlm: nn.Module) -> VisionEncoder:
    try:
        return vision_encoder(vlm)
    except UnsupportedMultiModalError as exc:
        logger.warning("%s; serving text only", exc)
        config = vlm.config
        token = getattr(config, "image_token_index", getattr(config, "image_token_id", -1))
        return RefusedVision(getattr(config, "model_type", "?"), str(exc), token)


def model_dir(model: Optional[str]) -> Optional[Path]:
    """The local folder of a model folder or hub id (loaders/loader.py's model_folder), or None (random, GGUF,
    PyPI models)."""
    if model is None or model.endswith(".gguf") or ":" in model.split("/")[0]:
        return None
    from pagedmlx.loaders.loader import model_folder

    return model_folder(model)


def read_config(model: Optional[str]) -> Optional[dict]:
    """config.json of a model's local folder, or None."""
    folder = model_dir(model)
    path = folder / "config.json" if folder is not None else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text())


def load_vision_encoder(model: Optional[str]) -> Optional[VisionEncoder]:
    """The vision path of a local mlx-vlm checkpoint (config.json with a vision_config), or None for a text model.
    Only the vision weights are read: mlx-vlm's language model is loaded lazily and dropped unread."""
    config = read_config(model)
    if not config or not config.get("vision_config"):
        return None
    try:
        from mlx_vlm.utils import load_model

        vlm = load_model(model_dir(model), lazy=True)
    except Exception as exc:  # noqa: BLE001 - no mlx-vlm (the vision extra), a version without the family, ...
        reason = f"images: mlx-vlm cannot load {model!r} ({type(exc).__name__}: {exc}; pip install 'pagedmlx[vision]')"
        logger.warning("%s; serving text only", reason)
        return RefusedVision(config.get("model_type", "?"), reason,
                             config.get("image_token_index", config.get("image_token_id", -1)))
    encoder = encoder_or_refusal(vlm)
    mx.eval(encoder.parameters())  # the tower and projector only: the language model (and an audio tower) stay unread
    return encoder


def load_mm_processor(model: Optional[str]):
    """The MultiModalProcessor of a local mlx-vlm checkpoint (its processor files), or None for a text model."""
    from pagedmlx.multimodal.processor import MultiModalProcessor

    config = read_config(model)
    if not config or not config.get("vision_config"):
        return None
    token = config.get("image_token_index", config.get("image_token_id"))
    try:
        from mlx_vlm.utils import load_processor

        hf_processor = load_processor(model_dir(model), add_detokenizer=False)
    except Exception as exc:  # noqa: BLE001 - missing processor files, a transformers version without the class
        logger.warning("images: cannot load the processor of %r (%s: %s); prompts take no images", model,
                       type(exc).__name__, exc)
        return None
    model_type = config.get("model_type", "")
    return MultiModalProcessor(hf_processor, token, model_type, hash_salt=(model_type,))

