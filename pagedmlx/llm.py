"""LLM: offline generation, as vLLM's `LLM` (`from pagedmlx import LLM, SamplingParams`).

All prompts given to one `generate` call share every forward pass. With tensor_parallel_size > 1
the same script runs on every rank (started here, or by mlx.launch): the constructor runs rank 0's
steps on the other ranks and then ends those processes, so the code after it runs on rank 0 only.
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any, Optional, Sequence, Union

import mlx.nn as nn

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.lora.request import LoRARequest
from pagedmlx.outputs import EngineOutput, RequestOutput, RequestOutputBuilder
from pagedmlx.request import fan_out
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.tp.launcher import launched_backend

# A prompt as vLLM takes it: text, token ids, {"prompt": text} or {"prompt_token_ids": ids}; with images,
# {"prompt": text, "multi_modal_data": {"image": image or [images]}} (PIL images or data: URLs; the text holds the
# model's image marker per image, e.g. Gemma's <start_of_image>).
PromptInput = Union[str, Sequence[int], dict]


class LLM:
    def __init__(self, model: Union[str, nn.Module, None] = None, tokenizer: Any = None,
                 tensor_parallel_size: int = 1, tp: Optional[int] = None, tp_timeout: float = 60.0,
                 **config: Any):
        """model: an mlx-lm folder or hub name, a .gguf file, `random:<arch>`, None (the default
        model), or an nn.Module with its tokenizer. tp is an alias of tensor_parallel_size; the
        other keywords are EngineConfig fields (block_size, max_num_seqs, kv_cache_memory_gb, ...).
        An mlx-vlm model object (or a folder of an mlx-vlm checkpoint) serves images too: its tokenizer is then
        its processor (pagedmlx/multimodal/)."""
        from pagedmlx.multimodal import load_mm_processor, split_vlm, vlm_processor

        size = tp or tensor_parallel_size
        self.mm_processor = None
        if size > 1 or launched_backend() is not None:
            self.engine = _tp_engine(model, tokenizer, size, tp_timeout, config)
        elif isinstance(model, nn.Module):
            mm_encoder = None
            if "vision_tower" in model:
                model, mm_encoder = split_vlm(model)
                self.mm_processor, tokenizer = vlm_processor(tokenizer, mm_encoder)
            self.engine = LLMEngine(model, tokenizer, EngineConfig(**config), mm_encoder=mm_encoder)
        else:
            self.engine = LLMEngine.from_config(EngineConfig(model=model, **config), tokenizer)
            self.mm_processor = load_mm_processor(model) if isinstance(model, str) else None
        self.tokenizer = self.engine.tokenizer
        self._counter = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer, llm._counter = engine, engine.tokenizer, itertools.count()
        llm.mm_processor = None
        return llm

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended values (its generation config) as defaults."""
        return self.engine.get_default_sampling_params()

    def generate(self, prompts: Union[PromptInput, Sequence[PromptInput]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: Optional[bool] = None,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order; `outputs[i]` is its i-th of n samples.
        lora_request: the adapter of every prompt, or one per prompt (None: the base model); the
        engine needs enable_lora=True."""
        prompts = _as_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora requests for {len(prompts)} prompts")
        requests = []  # (request id, prompt text or None, sample ids, adapter, detokenize)
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                rid, (text, ids, features) = str(next(self._counter)), self._unpack(prompt)
                requests.append((rid, text, [], lora, p.detokenize))
                for child_id, child_prompt, child_params in fan_out(rid, [ids if ids is not None else text], p):
                    self.engine.add_request(child_id, child_prompt, child_params, lora_request=lora,
                                            mm_features=features)
                    requests[-1][2].append(child_id)
        except BaseException:  # a refused prompt: the call adds nothing
            self.engine.abort_request([c for _, _, children, _, _ in requests for c in children])
            raise
        num_samples = sum(len(c) for _, _, c, _, _ in requests)
        done = self._run(num_samples, use_tqdm if use_tqdm is not None else num_samples >= 8)
        return [self._request_output(rid, text, [done[c] for c in child_ids], lora, detokenize)
                for rid, text, child_ids, lora, detokenize in requests]

    def chat(self, messages: Union[list[dict], Sequence[list[dict]]],
             sampling_params: Optional[SamplingParams] = None, use_tqdm: Optional[bool] = None,
             add_generation_prompt: bool = True, lora_request: Optional[LoRARequest] = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, through the tokenizer's chat template. Messages may
        hold OpenAI image parts ({"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}) or PIL
        images ({"type": "image_pil", "image_pil": img}) where the model takes images."""
        from pagedmlx.multimodal import has_images

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for c in conversations:
            if has_images(c):
                if self.mm_processor is None:
                    raise ValueError("this model takes no images (load an mlx-vlm checkpoint or model to send them)")
                ids, features = self.mm_processor.process_chat(c, add_generation_prompt)
                prompts.append({"prompt_token_ids": ids, "mm_features": features})
            else:
                prompts.append({"prompt_token_ids": self.tokenizer.apply_chat_template(
                    c, add_generation_prompt=add_generation_prompt)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _unpack(self, prompt: PromptInput) -> tuple[Optional[str], Optional[list[int]], Optional[list]]:
        """(text, token ids, image features) of one prompt; images go through the model's processor."""
        if isinstance(prompt, dict) and "mm_features" in prompt:
            return None, list(prompt["prompt_token_ids"]), list(prompt["mm_features"] or ()) or None
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            text, data = prompt.get("prompt"), prompt["multi_modal_data"] or {}
            if not isinstance(text, str) or set(prompt) != {"prompt", "multi_modal_data"}:
                raise ValueError("a prompt with multi_modal_data takes its text as 'prompt' (a string), got keys "
                                 f"{sorted(prompt)}")
            unknown = set(data) - {"image"}
            if unknown:
                raise ValueError(f"multi_modal_data takes 'image' only, got {sorted(unknown)}")
            if self.mm_processor is None:
                raise ValueError("this model takes no images (load an mlx-vlm checkpoint or model to send them)")
            images = data.get("image")
            images = list(images) if isinstance(images, (list, tuple)) else [] if images is None else [images]
            ids, features = self.mm_processor.process(text, images)
            return text, ids, features or None
        return (*_unpack(prompt), None)

    def close(self) -> None:
        """Let the other tensor-parallel ranks exit (nothing to do for one process)."""
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def _run(self, num_samples: int, show_progress: bool) -> dict[str, EngineOutput]:
        from rich.progress import Progress

        done: dict[str, EngineOutput] = {}
        with Progress(disable=not show_progress, transient=True) as progress:
            task = progress.add_task("generating", total=num_samples)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        progress.advance(task)
        return done

    def _request_output(self, rid: str, text: Optional[str], samples: list[EngineOutput],
                        lora_request: Optional[LoRARequest] = None, detokenize: bool = True) -> RequestOutput:
        builder = RequestOutputBuilder(rid, text, len(samples), self.tokenizer if detokenize else None, lora_request)
        for i, sample in enumerate(samples):
            output = builder.add(i, sample)
        return output


def _as_list(prompts: Union[PromptInput, Sequence[PromptInput]]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _unpack(prompt: PromptInput) -> tuple[Optional[str], Optional[list[int]]]:
    """(text, token ids) of one prompt; exactly one of them is given."""
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown or len(prompt) != 1:
            raise ValueError(f"a prompt dict takes exactly one of 'prompt' or 'prompt_token_ids', got keys "
                             f"{sorted(prompt)}")
        if "prompt" in prompt:
            return _unpack(prompt["prompt"]) if isinstance(prompt["prompt"], str) else _bad(prompt["prompt"])
        return None, list(prompt["prompt_token_ids"])
    if isinstance(prompt, str):
        return prompt, None
    return None, list(prompt)


def _bad(value: Any):
    raise ValueError(f"'prompt' must be a string, got {type(value).__name__}")


def _tp_engine(model: Any, tokenizer: Any, size: int, timeout: float, config: dict) -> LLMEngine:
    """Rank 0's engine over a tensor-parallel group; the other ranks never return from here."""
    from pagedmlx.loaders.loader import load_model
    from pagedmlx.tp.engine import build_engine, run_worker, unsupported
    from pagedmlx.tp.group import join_group

    by_name = not isinstance(model, nn.Module)
    name = model if by_name else None
    engine_config = EngineConfig(model=name, **config)
    why = unsupported(engine_config)
    if why:
        raise ValueError(why)
    group = join_group(size if size > 1 else None)
    if by_name:
        model, loaded_tokenizer = load_model(name, lazy=True, dtype=config.get("dtype"))
        tokenizer = tokenizer or loaded_tokenizer
    if group is None:
        engine = LLMEngine(model, tokenizer, engine_config)
    elif group.rank() > 0:
        code = run_worker(model, engine_config, group, timeout)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # nothing of the user's script runs on the other ranks
    else:
        engine = LLMEngine(core=build_engine(model, tokenizer, engine_config, group, timeout))
    if by_name:
        engine.load_generation_defaults(name)
    return engine
