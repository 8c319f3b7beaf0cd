"""Multimodal inputs (images), issue 51: vision-language models whose language model runs on pages.
media.py (the server's) loads and checks the images of OpenAI content parts; the rest is the engine's.

Interface for a front end (the server, LLM):

    from pagedmlx.multimodal import load_mm_processor
    processor = load_mm_processor(model_folder)        # MultiModalProcessor, or None for a text-only model
    ids, features = processor.process_chat(messages, add_generation_prompt=True,
                                           chat_template_kwargs=None, tools=None)
    ids, features = processor.process(prompt_text, images)   # text with the family's image marker per image

`messages` are OpenAI chat messages; an image part is {"type": "image_pil", "image_pil": <PIL.Image>} (what a
server puts after decoding and checking the upload) or
{"type": "image_url", "image_url": {"url": "data:...;base64,..."}}
(decoded here, data: URLs only). `features` is a list of MultiModalFeatureSpec (inputs.py): per image its content
hash (identifier), its placeholder range in `ids` and its processed arrays as bytes + dtype + shape (msgpack-safe).
Then give the engine the prompt as {"prompt_token_ids": ids, "mm_features": features}:
AsyncEngine.add_request / add_requests / generate take that dict as a prompt (the features cross to the engine-core
process in messages.AddRequest.mm_features), LLMEngine.add_request(..., mm_features=features) too.
A request with images for a model that takes none, or whose images are refused (e.g. a family without an
adapter), raises ValueError when added, with the reason; a front end can tell beforehand from AsyncEngine.info
(CoreInfo.takes_images, CoreInfo.images_refused).
Families: Gemma 3, Gemma 4 (models.py), Qwen3.5 / 3.6 with M-RoPE positions (qwen3_5.py, mrope.py).

Offline: LLM(model=<mlx-vlm folder or model object>, tokenizer=<its processor for an object>) then
LLM.generate({"prompt": text, "multi_modal_data": {"image": img_or_list}}) or LLM.chat(messages).

Inside the core: the scheduler's EncoderCacheManager (encoder_cache.py) budgets the image tokens a step encodes and
tracks which images' embeddings are needed; the runner's MultiModalRunner (runner.py) encodes each image once
(models.py: the family's tower and projector) and splices its rows into the step's input embeddings; prefix-cache
keys carry the identifiers of the images in each block (core/kv/block_hash.py's mm_extra_keys).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from pagedmlx.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData

__all__ = ["MultiModalFeatureSpec", "PlaceholderRange", "TensorData", "has_images", "load_mm_processor",
           "split_vlm", "vlm_processor"]


def load_mm_processor(model: Optional[str]):
    from pagedmlx.multimodal.loader import load_mm_processor as load

    return load(model)


def split_vlm(vlm: Any):
    from pagedmlx.multimodal.loader import split_vlm as split

    return split(vlm)


def vlm_processor(processor: Any, encoder: Any) -> tuple[Any, Any]:
    """(MultiModalProcessor or None, the engine's tokenizer) for an in-process model: `processor` is the model's
    processor (transformers/mlx-vlm, it has an image_processor) or a plain tokenizer (then no images in prompts)."""
    from pagedmlx.multimodal.processor import MultiModalProcessor

    if processor is None or not hasattr(processor, "image_processor"):
        return None, processor
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    mm = MultiModalProcessor(processor, getattr(encoder, "image_token_id", -1), getattr(encoder, "model_type", ""),
                             hash_salt=(getattr(encoder, "model_type", ""),))
    return mm, TokenizerWrapper(processor.tokenizer)


def has_images(messages: Sequence[dict]) -> bool:
    """Whether chat messages hold an image part."""
    return any(isinstance(p, dict) and p.get("type") in ("image_url", "image_pil", "image")
               for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list) for p in m["content"])
