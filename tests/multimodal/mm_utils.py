"""Tiny random-weight vision-language models (mlx-vlm classes), a processor for them, and mlx-vlm's own greedy
generation as the reference."""

from __future__ import annotations

import base64
import copy
import dataclasses
import functools
import io
from typing import Callable, Optional, Union

import mlx.core as mx
import numpy as np

from utils import Greedy, run_to_completion

from pagedmlx.loaders.random_model import tiny_tokenizer
from pagedmlx.multimodal.loader import build_vlm

BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
VOCAB = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + BOI + "{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Gemma 3: 16x16 images in 4x4 patches, pooled to 2x2 = 4 image tokens; 6 text layers, sliding window 8.
GEMMA3_VLM = dict(
    model_type="gemma3", hidden_size=64, image_token_index=VOCAB - 1, pad_token_id=0, vocab_size=VOCAB,
    text_config=dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, sliding_window=8,
                     sliding_window_pattern=3, mm_tokens_per_image=4, rms_norm_eps=1e-6, query_pre_attn_scalar=16,
                     max_position_embeddings=4096, rope_global_base_freq=1e6, rope_local_base_freq=1e4),
    vision_config=dict(model_type="siglip_vision_model", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                       num_attention_heads=2, patch_size=4, image_size=16, layer_norm_eps=1e-6))


@functools.lru_cache(maxsize=None)
def gemma3_vlm(seed: int = 0):
    return build_vlm(copy.deepcopy(GEMMA3_VLM), seed)


def gemma3_processor():
    """mlx-vlm's Gemma3Processor over the tiny tokenizer with Gemma's three image tokens (ids 509-511)."""
    from mlx_vlm.models.gemma3.processing_gemma3 import Gemma3Processor
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    hf = copy.deepcopy(tiny_tokenizer(VOCAB - 3)._tokenizer)
    hf.add_special_tokens({"additional_special_tokens": [BOI, EOI, IMAGE]})
    hf.boi_token, hf.eoi_token, hf.image_token = BOI, EOI, IMAGE
    hf.image_token_id = hf.convert_tokens_to_ids(IMAGE)
    hf.chat_template = CHAT_TEMPLATE
    assert hf.image_token_id == VOCAB - 1 and len(hf) == VOCAB
    image_processor = Gemma3ImageProcessorPil(size={"height": 16, "width": 16}, do_pan_and_scan=False)
    return Gemma3Processor(image_processor, hf, image_seq_length=4, chat_template=CHAT_TEMPLATE)


# Gemma 4 ("E" style: per-layer inputs, a KV-shared tail): 4x4 patches pooled 2x2, up to 16 image tokens per image
# (an image's count follows its aspect ratio); its image token is also the prompt's marker.
VIDEO = "<|video|>"
GEMMA4_VLM = dict(
    model_type="gemma4", hidden_size=64, image_token_id=VOCAB - 1, boi_token_id=VOCAB - 3, eoi_token_id=VOCAB - 2,
    audio_token_id=VOCAB, vocab_size=VOCAB, pad_token_id=0,
    text_config=dict(model_type="gemma4_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                     num_attention_heads=4, head_dim=16, global_head_dim=32, num_key_value_heads=1,
                     num_kv_shared_layers=2, hidden_size_per_layer_input=16, vocab_size=VOCAB,
                     vocab_size_per_layer_input=VOCAB, sliding_window=8, sliding_window_pattern=3,
                     final_logit_softcapping=30.0, use_double_wide_mlp=True, max_position_embeddings=4096,
                     rms_norm_eps=1e-6),
    vision_config=dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=16, global_head_dim=16, patch_size=4,
                       pooling_kernel_size=2, default_output_length=16, position_embedding_size=64))


@functools.lru_cache(maxsize=None)
def gemma4_vlm(seed: int = 0):
    return build_vlm(copy.deepcopy(GEMMA4_VLM), seed)


def gemma4_processor():
    """mlx-vlm's Gemma4Processor over the tiny tokenizer: <|video|>, boi, eoi, image as ids 508-511."""
    from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor, Gemma4Processor

    hf = copy.deepcopy(tiny_tokenizer(VOCAB - 4)._tokenizer)
    hf.add_special_tokens({"additional_special_tokens": [VIDEO, BOI, EOI, IMAGE]})
    hf.boi_token, hf.eoi_token, hf.image_token = BOI, EOI, IMAGE
    hf.image_token_id = hf.convert_tokens_to_ids(IMAGE)
    hf.chat_template = CHAT_TEMPLATE.replace(BOI, IMAGE)
    assert hf.image_token_id == VOCAB - 1 and len(hf) == VOCAB
    image_processor = Gemma4ImageProcessor(patch_size=4, max_soft_tokens=16, pooling_kernel_size=2)
    return Gemma4Processor(image_processor, hf, image_seq_length=16, chat_template=hf.chat_template)


# Qwen3.5 (Gated DeltaNet + M-RoPE attention): its images are refused, its text serves.
QWEN35_VLM = dict(
    model_type="qwen3_5", vocab_size=VOCAB, image_token_id=VOCAB - 1, video_token_id=VOCAB - 2,
    vision_start_token_id=VOCAB - 3, vision_end_token_id=VOCAB - 4,
    text_config=dict(model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_value_heads=4,
                     linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
                     linear_conv_kernel_dim=4, full_attention_interval=2, vocab_size=VOCAB, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, max_position_embeddings=4096,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                      "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
    vision_config=dict(model_type="qwen3_5", depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                       num_heads=2, patch_size=4, spatial_patch_size=4, num_position_embeddings=16))


@functools.lru_cache(maxsize=None)
def qwen35_vlm(seed: int = 0):
    return build_vlm(copy.deepcopy(QWEN35_VLM), seed)


def qwen35_processor():
    """mlx-vlm's (torch-free) Qwen3VLProcessor over the tiny tokenizer: 4x4 patches, 2x2 merged, at most 32x32
    pixels; <|vision_end|>, <|vision_start|>, <|video_pad|>, <|image_pad|> as ids 508-511."""
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor, Qwen3VLProcessor

    hf = copy.deepcopy(tiny_tokenizer(VOCAB - 4)._tokenizer)
    hf.add_special_tokens({"additional_special_tokens": ["<|vision_end|>", "<|vision_start|>", "<|video_pad|>",
                                                        "<|image_pad|>"]})
    assert hf.convert_tokens_to_ids("<|image_pad|>") == QWEN35_VLM["image_token_id"] and len(hf) == VOCAB
    image_processor = Qwen3VLImageProcessor(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8,
                                            max_pixels=32 * 32)
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=hf,
                            chat_template=CHAT_TEMPLATE.replace(BOI, QWEN_MARKER))


QWEN_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"


def stacked_reference_inputs(features) -> tuple[Optional[mx.array], dict]:
    """Qwen-VL style: every image's patches in one array, and image_grid_thw."""
    if not features:
        return None, {}
    grid = mx.concatenate([f.data["image_grid_thw"].mx() for f in features])
    return mx.concatenate([f.data["pixel_values"].mx() for f in features]), {"image_grid_thw": grid}


def batched_reference_inputs(features) -> tuple[Union[None, mx.array, list], dict]:
    return pixels_of(features), {}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    vlm: Callable
    processor: Callable
    marker: str  # what a prompt's text holds per image
    reference_inputs: Callable = batched_reference_inputs  # features -> (pixel values, kwargs) for mlx-vlm


FAMILIES = {"gemma3": Family("gemma3", gemma3_vlm, gemma3_processor, BOI),
            "gemma4": Family("gemma4", gemma4_vlm, gemma4_processor, IMAGE),
            "qwen3_5": Family("qwen3_5", qwen35_vlm, qwen35_processor, QWEN_MARKER, stacked_reference_inputs)}


def family_reference(family: Family, vlm, features):
    """mlx-vlm's greedy continuation reference for a prompt with these images (greedy_mismatch's)."""
    pixels, kwargs = family.reference_inputs(features)
    return vlm_reference(vlm, pixels, **kwargs)


def encode(picture, fmt: str = "PNG") -> bytes:
    """A PIL image as the bytes of a `fmt` file."""
    buf = io.BytesIO()
    picture.save(buf, fmt)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image(seed: int, size: tuple[int, int] = (24, 20)):
    """A random RGB PIL image."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def run_arriving(engine, prompts: dict, params) -> dict:
    """Adds the processed prompts {rid: (ids, features)} one by one, two steps after every second one (requests
    arrive while others prefill and decode), then runs the engine dry; {rid: its finished output}."""
    done = {}
    for i, (rid, (ids, features)) in enumerate(prompts.items()):
        engine.add_request(rid, ids, params, mm_features=features)
        if i % 2:
            for out in engine.step() + engine.step():
                if out.finished:
                    done[out.request_id] = out
    done.update(run_to_completion(engine))
    return done


def vlm_greedy(vlm, prompt: list[int], pixel_values: Optional[mx.array], max_tokens: int, **kwargs) -> Greedy:
    """mlx-vlm's own greedy generation for one prompt (with its images' pixel values) alone."""
    from mlx_vlm.generate.ar import generate_step

    out = Greedy()
    steps = generate_step(mx.array(prompt)[None], vlm, pixel_values, mx.ones((1, len(prompt)), mx.int32),
                          max_tokens=max_tokens, temperature=0.0,
                          **kwargs)
    for (tok, logprobs), _ in zip(steps, range(max_tokens)):
        out.add(int(tok), logprobs)
    return out


def vlm_reference(vlm, pixel_values: Optional[mx.array], **kwargs):
    """A greedy_mismatch reference: mlx-vlm's continuation of a prompt that starts with these images' prompt."""
    return lambda prompt, max_tokens: vlm_greedy(vlm, prompt, pixel_values, max_tokens, **kwargs)


def pixels_of(features) -> Union[None, mx.array, list]:
    """The pixel values of a request's features as mlx-vlm takes them: stacked, or a list where shapes differ
    (None: no image)."""
    if not features:
        return None
    items = [f.data["pixel_values"].mx() for f in features]
    if len({a.shape for a in items}) > 1:
        return [a[0] for a in items]
    return mx.concatenate(items)
