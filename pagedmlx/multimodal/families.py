"""Which family adapter serves an mlx-vlm model's images (models.py: Gemma 3 and 4; qwen3_5.py: Qwen3.5 / 3.6)."""

from __future__ import annotations

import mlx.nn as nn

from pagedmlx.multimodal.models import Gemma3Vision, Gemma4Vision, UnsupportedMultiModalError, VisionEncoder
from pagedmlx.multimodal.qwen3_5 import Qwen35Vision

FAMILIES = {"gemma3": Gemma3Vision, "gemma4": Gemma4Vision, "qwen3_5": Qwen35Vision, "qwen3_5_moe": Qwen35Vision}

# Families mlx-vlm serves whose images need what the paged text model does not do: model type -> why.
REFUSED: dict[str, str] = {}


def vision_encoder(vlm: nn.Module) -> VisionEncoder:
    """The family adapter of an mlx-vlm model (UnsupportedMultiModalError naming why, if none)."""
    model_type = getattr(getattr(vlm, "config", None), "model_type", None) or getattr(vlm, "model_type", None)
    if model_type in REFUSED:
        raise UnsupportedMultiModalError(f"images are not served for model type {model_type!r}: {REFUSED[model_type]}")
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedMultiModalError(f"images are not served for model type {model_type!r} yet (served: "
                                         f"{', '.join(sorted(FAMILIES))})")
    return family(vlm)
