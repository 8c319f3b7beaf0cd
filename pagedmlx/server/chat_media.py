"""The images of a chat request: its image parts counted against --limit-mm-per-prompt, loaded and checked
(multimodal/media.py), and handed with the messages to the model's processor (pagedmlx/multimodal/), which
gives the prompt's token ids and the images' features. This runs in the tokenizing pool (prompts.py), never
on the event loop: decoding a large image takes a while."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from jinja2 import TemplateError

from pagedmlx.multimodal.media import MediaConnector, MediaError
from pagedmlx.server.chat_tools import template_kwargs, tool_text_length
from pagedmlx.server.prompts import PromptEncoder
from pagedmlx.server.protocol import APIError, ChatCompletionRequest

MODALITIES = ("image",)
DEFAULT_LIMIT_MM_PER_PROMPT = {"image": 8}
VISION_MAX_BODY_BYTES = 32 << 20  # --max-body-bytes' default for a model that takes images (base64: 4/3 the bytes)


def parse_limit_mm_per_prompt(text: str) -> dict[str, int]:
    """vLLM's --limit-mm-per-prompt: JSON such as '{"image": 4}' (0 turns images off), or vLLM's newer form
    '{"image": {"count": 4, "width": 512, "height": 512}}' (the sizes are vLLM's memory-profiling hints, unused
    here); ValueError saying why."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"must be JSON such as '{{\"image\": 4}}' ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object such as '{\"image\": 4}'")
    limits = {}
    for key, limit in value.items():
        if key not in MODALITIES:
            raise ValueError(f"{key!r}: the modalities served are {', '.join(MODALITIES)}")
        count = limit.get("count") if isinstance(limit, dict) else limit
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"{key!r}: the limit must be an integer >= 0 (or {{\"count\": N}}), got {limit!r}")
        limits[key] = count
    return {**DEFAULT_LIMIT_MM_PER_PROMPT, **limits}


@dataclass(frozen=True)
class MediaOptions:
    """The server's media options: where file:// URLs may read (--allowed-local-media-path) and how many
    images one request may carry (--limit-mm-per-prompt)."""

    allowed_local_media_path: Optional[Path] = None
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_LIMIT_MM_PER_PROMPT))

    def connector(self) -> MediaConnector:
        return MediaConnector(self.allowed_local_media_path)

    @property
    def image_limit(self) -> int:
        return self.limit_mm_per_prompt.get("image", DEFAULT_LIMIT_MM_PER_PROMPT["image"])

    def describe(self) -> str:
        where = f"file:// under {self.allowed_local_media_path}" if self.allowed_local_media_path else "no local files"
        return f"at most {self.image_limit} a request; data: URLs, {where}"


def chat_messages(req: ChatCompletionRequest, media: Optional[MediaConnector], limit: int,
                  refused: Optional[str] = None) -> tuple[list[dict], int]:
    """The messages for the chat template, each image part as {"type": "image_pil", "image_pil": <PIL image,
    RGB>} (the engine's processor takes them so), and the number of images. `refused`: why this model takes
    no images (None: it takes them). A part refused, over `limit` or that gives no usable image is a 400
    naming it (`messages[0].content[1].image_url`)."""
    parts = [p for i, m in enumerate(req.messages) for p in m.image_parts(i)]
    if parts and refused is not None:
        raise APIError(400, f"{parts[0][0]}: this model takes no images ({refused}): send text content parts only",
                       param=parts[0][0])
    messages = [m.to_template_dict(i, images=bool(parts)) for i, m in enumerate(req.messages)]
    if not parts:
        return messages, 0
    if len(parts) > limit:
        param = parts[limit][0]
        raise APIError(400, f"{param}: at most {limit} image{'s' if limit != 1 else ''} may be sent in one request "
                       f"(--limit-mm-per-prompt), got {len(parts)}", param=param)
    media = media or MediaConnector()
    images = []
    for param, part in parts:
        try:
            images.append(media.fetch_image(part.url, param + ".image_url"))
        except MediaError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
    loaded = iter(images)
    for message in messages:
        if isinstance(message["content"], list):
            message["content"] = [{"type": "image_pil", "image_pil": next(loaded)} if p["type"] == "image" else p
                                  for p in message["content"]]
    return messages, len(images)


class ChatPrompts:
    """A chat request's prompt: its token ids and, where it carries images, their processed features
    (`processor`: the model's MultiModalProcessor, pagedmlx/multimodal/; None for a text-only model;
    `info`: the engine's CoreInfo, which says whether the core serves images)."""

    def __init__(self, prompts: PromptEncoder, processor: Any, media: MediaOptions, info: Any = None):
        self.prompts, self.processor = prompts, processor
        self.media, self.connector = media, media.connector()
        self.refused = images_refused(processor, info)

    def prompt(self, req: ChatCompletionRequest) -> tuple[list[int], Optional[list]]:
        kwargs = template_kwargs(req)
        messages, num_images = chat_messages(req, self.connector, self.media.image_limit, self.refused)
        if not num_images:
            ids = self.prompts.apply_chat_template(messages, req.add_generation_prompt, tool_text_length(req),
                                                   **kwargs)
            return ids, None
        self.prompts.check_messages_fit(messages, tool_text_length(req))
        try:
            ids, features = self.processor.process_chat(messages, add_generation_prompt=req.add_generation_prompt,
                                                        tools=kwargs.pop("tools", None), chat_template_kwargs=kwargs)
        except (ValueError, TypeError, TemplateError) as exc:  # the model's processor or template refuses them
            raise APIError(400, f"the model's processor failed on these messages: {exc}", param="messages") from None
        return list(ids), list(features)


def images_refused(processor: Any, info: Any) -> Optional[str]:
    """Why chat images are refused (None: they are served): no processor, or a core that does not take them."""
    if getattr(info, "images_refused", ""):
        return info.images_refused
    if info is not None and not getattr(info, "takes_images", True):
        return "it is a text-only model"
    if processor is None:
        return "the server could not load the model's image processor"
    return None
