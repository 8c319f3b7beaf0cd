"""Prompt processing for images (vLLM's input processor): text or chat messages plus PIL images -> prompt token ids
with each image's placeholder tokens expanded, and one MultiModalFeatureSpec per image.

The model's own processor does the work (mlx-vlm's processor classes, or transformers'): it resizes and normalises
the images and expands each image marker into the family's placeholder sequence. This module finds the expanded
runs of the image token, cuts the processed arrays per image and hashes them."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from pagedmlx.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData, content_hash

# Outputs of a processor that are about the text, not an image.
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "num_crops"})


class MultiModalProcessor:
    def __init__(self, hf_processor: Any, image_token_id: int, model_type: str = "", hash_salt: Sequence[Any] = ()):
        """hf_processor: the model's processor (it takes text= and images=, and renders chat templates);
        image_token_id: the placeholder token its expansion repeats; hash_salt: joins every image's identifier
        (e.g. the model's name: another model's processing of the same bytes is another item)."""
        self.hf_processor = hf_processor
        self.image_token_id = image_token_id
        self.model_type = model_type
        self.hash_salt = tuple(hash_salt)

    @property
    def tokenizer(self) -> Any:
        return getattr(self.hf_processor, "tokenizer", self.hf_processor)

    def process(self, prompt: str, images: Sequence[Any] = (), add_special_tokens: bool = True
                ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """Token ids and features of a text prompt holding one image marker per image (the family's: Gemma's
        <start_of_image>); without images, the text's token ids and no features."""
        images = [to_pil(im, f"image {i}") for i, im in enumerate(images)]
        if not images:
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)), []
        try:
            out = self.hf_processor(text=[prompt], images=[images], add_special_tokens=add_special_tokens)
        except Exception as exc:  # noqa: BLE001 - processors raise ValueError, TypeError, IndexError, ...
            raise ValueError(f"the model's processor refused the prompt with {len(images)} images "
                             f"({type(exc).__name__}: {exc})") from None
        ids = np.asarray(out["input_ids"]).reshape(-1).astype(np.int64).tolist()
        runs = placeholder_runs(ids, self.image_token_id)
        per_image = _per_image(out)
        if not runs:
            raise ValueError(f"the prompt has no image marker for its {len(images)} images (the processor expanded "
                             f"none into image token {self.image_token_id})")
        bad = {k: len(v) for k, v in per_image.items() if len(v) != len(runs)}
        if bad or "pixel_values" not in per_image:
            raise ValueError(f"{len(runs)} placeholder runs of image token {self.image_token_id} for processed "
                             f"arrays of {({k: len(v) for k, v in per_image.items()})} items")
        features = []
        for i, (offset, length) in enumerate(runs):
            data = {k: TensorData.from_array(v[i]) for k, v in per_image.items()}
            features.append(MultiModalFeatureSpec(data, "image", content_hash(data, self.hash_salt),
                                                  PlaceholderRange(offset, length)))
        return ids, features

    def process_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                     chat_template_kwargs: Optional[dict] = None, tools: Optional[list] = None
                     ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """OpenAI chat messages -> (prompt token ids, features). Image parts: {"type": "image_url", "image_url":
        {"url": "data:image/...;base64,..."}} or a decoded PIL image as {"type": "image_pil", "image_pil": img}
        (also "image": img); each becomes the template's image marker, in order."""
        conversation, images = chat_parts(messages)
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        template_owner = self.hf_processor if getattr(self.hf_processor, "chat_template", None) else self.tokenizer
        text = template_owner.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)
        return self.process(text, images, add_special_tokens=False)


def _per_image(out: Any) -> dict[str, list[np.ndarray]]:
    """A processor's image outputs cut per image, each with a leading axis to concatenate along: a batched array's
    rows (1, ...) or a list's arrays (images of other shapes); where the processor gives image_grid_thw (Qwen-VL
    style), the arrays that hold every image's patches in one go are cut by each image's t * h * w patches."""
    per_image = {k: items for k, v in out.items() if k not in _TEXT_KEYS and (items := _items(v)) is not None}
    grid = out.get("image_grid_thw") if hasattr(out, "get") else None
    if grid is not None:
        ends = np.cumsum(np.prod(np.asarray(grid), axis=1))
        for k, v in out.items():
            if k != "image_grid_thw" and k in per_image and np.asarray(v).shape[0] == ends[-1] != len(ends):
                a = np.asarray(v)
                per_image[k] = [a[start:end] for start, end in zip(np.concatenate([[0], ends[:-1]]), ends)]
    return per_image


def _items(value: Any) -> Optional[list[np.ndarray]]:
    if isinstance(value, (list, tuple)):
        items = [np.asarray(v) for v in value]
        return [a[None] for a in items] if items and all(a.ndim > 0 and a.dtype.kind in "fiub" for a in items) \
            else None
    if hasattr(value, "shape") and len(value.shape) > 0:
        return [a[None] for a in np.asarray(value)]
    return None


def placeholder_runs(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of image_token_id."""
    ids = np.asarray(token_ids)
    hit = np.concatenate([[False], ids == image_token_id, [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


def chat_parts(messages: Sequence[dict]) -> tuple[list[dict], list[Any]]:
    """The messages with every image part as {"type": "image"} (what chat templates render as the marker), and the
    images in order (PIL images, data: URLs decoded)."""
    conversation, images = [], []
    for m, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{m}] must be a dict, got {type(message).__name__}")
        content = message.get("content")
        if not isinstance(content, list):
            conversation.append(dict(message))
            continue
        parts = []
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{m}].content[{p}]"
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(decode_image_url(url, where))
                parts.append({"type": "image"})
            elif kind in ("image_pil", "image"):
                image = part.get(kind)
                if image is not None:
                    images.append(to_pil(image, where))
                parts.append({"type": "image"})
            elif kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            else:
                raise ValueError(f"{where}: unsupported content part type {kind!r} (text, image_url, image_pil)")
        conversation.append({**message, "content": parts})
    return conversation, images


def decode_image_url(url: Any, where: str = "image_url") -> Any:
    """A data: URL (base64) as an RGB PIL image, decoded and checked as the server does (media.py); other URLs
    are refused (no fetching here). MediaError (a ValueError) naming `where` otherwise."""
    from pagedmlx.multimodal.media import MediaConnector

    if not isinstance(url, str):
        raise ValueError(f"{where}: an image URL must be a string, got {type(url).__name__}")
    return MediaConnector().fetch_image(url, where)


def to_pil(image: Any, where: str = "image") -> Any:
    from PIL import Image

    if isinstance(image, Image.Image):
        from pagedmlx.multimodal.media import to_rgb

        return to_rgb(image) if image.mode != "RGB" else image  # transparency over white, as the server
    if isinstance(image, str):
        return decode_image_url(image, where)
    raise ValueError(f"{where}: expected a PIL image or a data: URL, got {type(image).__name__}")
