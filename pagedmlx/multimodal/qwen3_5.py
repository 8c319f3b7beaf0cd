"""Qwen3.5 / 3.6 images: mlx-vlm's vision tower and merger, M-RoPE positions (multimodal/mrope.py), and the text
model's attention layers rotating image rows by their (t, h, w) positions with mlx-vlm's own rotary embedding.

Other rows keep mlx-lm's RoPE at their (shifted) positions: where t = h = w, M-RoPE is plain RoPE."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from pagedmlx.multimodal import mrope
from pagedmlx.multimodal.inputs import MultiModalFeatureSpec
from pagedmlx.multimodal.models import UnsupportedMultiModalError, VisionEncoder, stacked


class MRoPERows:
    """The step's image rows and their (t, h, w) positions while a step with image rows is built, else None."""

    def __init__(self) -> None:
        self.value: Optional[tuple[mx.array, mx.array]] = None


class MRoPEAttentionRope(nn.Module):
    """Wraps an mlx-lm attention layer's rope: rows of image tokens (while set) take mlx-vlm's M-RoPE."""

    def __init__(self, rope: nn.Module, rotary: Any, rows: MRoPERows):
        super().__init__()
        self.rope = rope
        object.__setattr__(self, "_rotary", rotary)  # mlx-vlm's (no weights): kept out of the parameter tree
        object.__setattr__(self, "_rows", rows)

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        y = self.rope(x, offset=offset)
        if self._rows.value is None:
            return y
        rows, positions = self._rows.value  # (K,), (3, K)
        xs = x[rows]  # (K, heads, 1, head_dim): token-major rows
        rotated, _ = self._rotary.apply_rotary(xs, xs, positions[:, :, None], unsqueeze_dim=1)
        y[rows] = rotated.astype(y.dtype)
        return y


class Qwen35Vision(VisionEncoder):
    def __init__(self, vlm: nn.Module):
        config = vlm.config
        self.model_type = config.model_type
        index = getattr(config, "image_token_index", None)
        self.image_token_id = index if index is not None else config.image_token_id
        self.tower = vlm.vision_tower
        self.modules = (self.tower,)
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        layers = vlm.language_model.model.layers
        self.rotary = next((layer.self_attn.rotary_emb for layer in layers
                            if hasattr(getattr(layer, "self_attn", None), "rotary_emb")), None)
        if self.rotary is None:
            raise UnsupportedMultiModalError(f"{self.model_type}: mlx-vlm's model has no attention layer with a "
                                             "rotary embedding to rotate image rows by")
        self.rows = MRoPERows()

    def annotate(self, features: list[MultiModalFeatureSpec]) -> list[MultiModalFeatureSpec]:
        return mrope.annotate(features, self.spatial_merge_size)

    def encode_stacked(self, features: list[MultiModalFeatureSpec], dtype: mx.Dtype) -> list[mx.array]:
        pixels = stacked(features, "pixel_values").astype(self.tower.patch_embed.proj.weight.dtype)
        hidden, _ = self.tower(pixels, stacked(features, "image_grid_thw"))
        rows = hidden.astype(dtype)
        ends = list(itertools.accumulate(f.mm_position.length for f in features))
        if rows.shape[0] != ends[-1]:
            raise ValueError(f"qwen3_5: the tower gives {rows.shape[0]} rows for {ends[-1]} placeholder tokens")
        return [rows[end - f.mm_position.length:end] for f, end in zip(features, ends)]

    def install(self, model: nn.Module) -> None:
        """Wrap the rope of every attention layer of mlx-lm's text model (linear-attention layers have none)."""
        text = getattr(model, "language_model", model)
        for layer in text.model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is not None and not isinstance(attn.rope, MRoPEAttentionRope):
                attn.rope = MRoPEAttentionRope(attn.rope, self.rotary, self.rows)

    @contextlib.contextmanager
    def forward_context(self, body: nn.Module, so: Any = None) -> Iterator[None]:
        if so is not None and len(so.mrope_rows):
            self.rows.value = (mx.array(so.mrope_rows), mx.array(so.mrope_positions))
        try:
            yield
        finally:
            self.rows.value = None
