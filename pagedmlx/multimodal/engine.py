"""The engine core's side of images: the runner's encoder attached at start, and each request's features checked
when it is added."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from pagedmlx.multimodal.inputs import MultiModalFeatureSpec, check_features
from pagedmlx.multimodal.loader import RefusedVision
from pagedmlx.multimodal.models import UnsupportedMultiModalError, VisionEncoder


def attach_encoder(runner: Any, encoder: Optional[VisionEncoder]) -> Optional[VisionEncoder]:
    """Give the runner its MultiModalRunner (a RefusedVision stays with the core: its requests are refused)."""
    if encoder is None or isinstance(encoder, RefusedVision):
        return encoder
    from pagedmlx.multimodal.runner import MultiModalRunner
    from pagedmlx.runner.lm_head import split_lm_head
    from pagedmlx.runner.model import ModelRunner

    if not isinstance(runner, ModelRunner):
        raise ValueError("images are not served with tensor parallelism yet")
    body, _ = split_lm_head(runner.model)
    if body is None or not hasattr(body, "embed_tokens"):
        raise UnsupportedMultiModalError(f"{encoder.model_type}: the text model has no embed_tokens body to take "
                                         "input embeddings")
    runner.mm = MultiModalRunner(encoder, body)
    encoder.install(runner.model)
    return encoder


def check_mm_request(encoder: Optional[VisionEncoder], prompt_token_ids: Sequence[int],
                     mm_features: Optional[Sequence[MultiModalFeatureSpec]]) -> list[MultiModalFeatureSpec]:
    """The request's features, checked: the model takes images, and each placeholder range lies in the prompt and
    holds only the image token (a ValueError naming the item otherwise)."""
    if not mm_features:
        return []
    if encoder is None:
        raise ValueError("this model takes no images (its checkpoint has no vision_config): send text only")
    if isinstance(encoder, RefusedVision):
        raise ValueError(encoder.reason)
    features = list(mm_features)
    check_features(features, prompt_token_ids)
    for i, f in enumerate(features):
        pos = f.mm_position
        wrong = [t for t in prompt_token_ids[pos.offset:pos.end] if t != encoder.image_token_id]
        if wrong:
            raise ValueError(f"mm_features[{i}]: its placeholder range [{pos.offset}, {pos.end}) holds token ids "
                             f"{wrong[:3]}, not only the image token {encoder.image_token_id}")
    return encoder.annotate(features)
