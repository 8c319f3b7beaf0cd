"""Per family: the vision tower and projector of an mlx-vlm model, and the rows they give the language model.

mlx-vlm's `Model.get_input_embeddings` is the reference: what it puts in an image token's row is what `encode`
returns here, in the units of mlx-lm's `input_embeddings` (before the text model's own scaling). A family or a
config this module cannot reproduce exactly is refused by name (UnsupportedMultiModalError), never approximated."""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn

from pagedmlx.multimodal.inputs import MultiModalFeatureSpec

logger = logging.getLogger("pagedmlx")


class UnsupportedMultiModalError(ValueError):
    """A vision-language model whose images this engine cannot serve exactly; the text model may still serve."""


class VisionEncoder:
    """One family's image path: `encode` turns one image's processed inputs into the rows that replace its
    placeholder tokens in the language model's input embeddings; `input_embeddings` gives the text model's keyword
    arguments for a step with image rows, and `forward_context` wraps its call."""

    model_type: str = ""
    image_token_id: int = -1
    modules: tuple = ()  # the mlx-vlm modules it runs (tower, projector)
    # The tokens of one image (a run of adjacent placeholder ranges) attend each other both ways, over the causal
    # mask, in every attention layer (Gemma 4 use_bidirectional_attention="vision").
    bidirectional: bool = False

    def parameters(self) -> list:
        return [m.parameters() for m in self.modules]

    def encode(self, feature: MultiModalFeatureSpec, dtype: mx.Dtype) -> mx.array:
        """One image's rows (length, hidden)."""
        return self.encode_batch([feature], dtype)[0]

    def encode_batch(self, features: list[MultiModalFeatureSpec], dtype: mx.Dtype) -> list[mx.array]:
        """Several images' rows: one tower call per set of images whose inputs share their shapes (a step's
        images run together, as vLLM's encoder inputs of a step do)."""
        out: list = [None] * len(features)
        groups: dict = {}
        for i, f in enumerate(features):
            groups.setdefault(tuple((k, t.dtype, t.shape) for k, t in sorted(f.data.items())), []).append(i)
        for idx in groups.values():
            for i, rows in zip(idx, self.encode_stacked([features[i] for i in idx], dtype)):
                out[i] = rows
        return out

    def encode_stacked(self, features: list[MultiModalFeatureSpec], dtype: mx.Dtype) -> list[mx.array]:
        """The rows of images whose inputs share their shapes, in one call of the tower."""
        raise NotImplementedError

    def input_embeddings(self, body: nn.Module, input_ids: mx.array, image_rows: mx.array,
                         image_embeds: mx.array) -> dict[str, Any]:
        """The keyword arguments of mlx-lm's text model body for a step: input_ids (T,) with image rows
        image_rows (K,) taking image_embeds (K, hidden), one take over the step's rows."""
        return {"input_embeddings": splice(body.embed_tokens(input_ids), image_rows, image_embeds)[:, None, :]}

    @contextlib.contextmanager
    def forward_context(self, body: nn.Module, so: Any = None) -> Iterator[None]:
        """Around the text model's call on a step with image rows (the graph is built inside); so: the step."""
        yield

    def annotate(self, features: list[MultiModalFeatureSpec]) -> list[MultiModalFeatureSpec]:
        """A request's features as the core keeps them (M-RoPE families add their positions)."""
        return features

    def install(self, model: nn.Module) -> None:
        """Changes to mlx-lm's text model the family needs (once, when the runner takes the encoder)."""


class Gemma3Vision(VisionEncoder):
    """Gemma 3: SigLIP tower, average-pooled and projected; mlx-vlm divides the features by sqrt(hidden_size)
    (its config's) because the text model multiplies every input row by sqrt(hidden_size)."""

    def __init__(self, vlm: nn.Module):
        config = vlm.config
        self.model_type = config.model_type
        self.image_token_id = config.image_token_index
        self.tower, self.projector = vlm.vision_tower, vlm.multi_modal_projector
        self.modules = (self.tower, self.projector)
        self.hidden_size = config.hidden_size
        text_hidden = config.text_config.hidden_size
        if self.hidden_size != text_hidden:  # mlx-vlm's default 2048 where config.json has no top-level hidden_size
            logger.warning("gemma3: image features are divided by sqrt(hidden_size=%d) as mlx-vlm does, while the "
                           "text model multiplies by sqrt(%d): image rows are %.3fx what cancels exactly (as in "
                           "mlx-vlm)", self.hidden_size, text_hidden, (text_hidden / self.hidden_size) ** 0.5)

    def encode_stacked(self, features: list[MultiModalFeatureSpec], dtype: mx.Dtype) -> list[mx.array]:
        pixels = stacked(features, "pixel_values")
        hidden, _, _ = self.tower(pixels.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True)
        rows = (self.projector(hidden) / (self.hidden_size ** 0.5)).astype(dtype)
        return [rows[i] for i in range(len(features))]


class Gemma4Vision(VisionEncoder):
    """Gemma 4: the tower takes pixel patches and their positions; embed_vision projects. mlx-vlm feeds the
    projected rows unscaled while it scales text rows by embed_scale before the text model, and takes the
    per-layer inputs of image rows from token 0: a step with image rows does the same (multimodal/runner.py)."""

    def __init__(self, vlm: nn.Module):
        config = vlm.config
        self.model_type = config.model_type
        self.image_token_id = config.image_token_id
        self.tower, self.embedder = vlm.vision_tower, vlm.embed_vision
        self.modules = (self.tower, self.embedder)
        bidirectional = getattr(config.text_config, "use_bidirectional_attention", None)
        if bidirectional and bidirectional != "vision":
            raise UnsupportedMultiModalError(
                f"gemma4: text_config.use_bidirectional_attention={bidirectional!r} is not served with images")
        self.bidirectional = bidirectional == "vision"

    def encode_stacked(self, features: list[MultiModalFeatureSpec], dtype: mx.Dtype) -> list[mx.array]:
        """The tower drops each image's padding and concatenates the images' rows: (1, sum of lengths, hidden)."""
        positions = stacked(features, "image_position_ids") if "image_position_ids" in features[0].data else None
        rows = self.embedder(self.tower(stacked(features, "pixel_values"), positions)).astype(dtype)[0]
        ends = list(itertools.accumulate(f.mm_position.length for f in features))
        if rows.shape[0] != ends[-1]:
            raise ValueError(f"gemma4: the tower gives {rows.shape[0]} rows for {ends[-1]} placeholder tokens")
        return [rows[end - f.mm_position.length:end] for f, end in zip(features, ends)]

    def input_embeddings(self, body: nn.Module, input_ids: mx.array, image_rows: mx.array,
                         image_embeds: mx.array) -> dict[str, Any]:
        """Text rows embed_tokens * embed_scale and image rows as projected, as mlx-vlm's get_input_embeddings;
        forward_context has mlx-lm's body scale by 1.0 (x * s / s is not always x). Per-layer inputs from the
        token ids with image rows as token 0."""
        embeds = splice(body.embed_tokens(input_ids) * body.embed_scale, image_rows, image_embeds)
        kwargs = {"input_embeddings": embeds[:, None, :]}
        if body.hidden_size_per_layer_input:
            text_ids = mx.put_along_axis(input_ids, image_rows, mx.zeros(image_rows.shape, input_ids.dtype), axis=0)
            kwargs["per_layer_inputs"] = body._get_per_layer_inputs(text_ids[:, None])
        return kwargs

    @contextlib.contextmanager
    def forward_context(self, body: nn.Module, so: Any = None) -> Iterator[None]:
        scale, body.embed_scale = body.embed_scale, 1.0
        try:
            yield
        finally:
            body.embed_scale = scale


def splice(embeds: mx.array, image_rows: mx.array, image_embeds: mx.array) -> mx.array:
    """embeds (T, H) with rows image_rows (K,) replaced by image_embeds (K, H): one take over the step's rows."""
    t = embeds.shape[0]
    index = mx.put_along_axis(mx.arange(t), image_rows, mx.arange(t, t + image_rows.shape[0]), axis=0)
    return mx.take(mx.concatenate([embeds, image_embeds.astype(embeds.dtype)]), index, axis=0)


def stacked(features: list[MultiModalFeatureSpec], name: str) -> mx.array:
    """The images' inputs `name` along the batch axis (each feature holds one image: a leading axis of 1)."""
    missing = [f.identifier[:12] for f in features if name not in f.data]
    if missing:
        raise ValueError(f"images {missing}: their processed inputs lack {name!r}")
    arrays = [f.data[name].mx() for f in features]
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays)
