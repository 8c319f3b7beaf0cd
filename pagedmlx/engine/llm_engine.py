"""LLMEngine (vLLM's name): an EngineCore and an OutputProcessor in the caller's thread, for offline
generation (llm.py) and tests. `step()` returns EngineOutputs with text.

The core's state reads (and writes) through: `engine.scheduler`, `engine.kv_cache_manager`,
`engine.runner`, `engine.stats`, `engine.config`, ... are the core's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

from pagedmlx.config import EngineConfig
from pagedmlx.lora.request import LoRARequest
from pagedmlx.engine.output_processor import OutputProcessor
from pagedmlx.outputs import EngineCoreOutput, EngineOutput
from pagedmlx.request import Request
from pagedmlx.sampling_params import SamplingParams

if TYPE_CHECKING:  # the server's front end imports this module (encode_prompt) but runs no core of its own
    import mlx.nn as nn

    from pagedmlx.engine.core import EngineCore

# Text, token ids, or a processed multimodal prompt {"prompt_token_ids": ids, "mm_features": [...]}
# (pagedmlx/multimodal/: MultiModalProcessor.process / process_chat give its two parts).
PromptType = Union[str, Sequence[int], dict]


def prompt_mm_features(prompt: PromptType) -> Optional[list]:
    """The features of a processed multimodal prompt (None for text or token ids)."""
    return list(prompt.get("mm_features") or ()) or None if isinstance(prompt, dict) else None


def encode_prompt(tokenizer: Any, prompt: PromptType) -> list[int]:
    """A prompt's token ids: text through the tokenizer, ids as given (the core checks their range)."""
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt_token_ids", "mm_features"}
        if unknown or "prompt_token_ids" not in prompt:
            raise ValueError(f"a processed prompt takes 'prompt_token_ids' and 'mm_features', got {sorted(prompt)}")
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer: give prompts as token ids")
        return list(tokenizer.encode(prompt))
    return list(prompt)


class LLMEngine:
    _OWN = frozenset({"core", "tokenizer", "processor"})

    def __init__(self, model: Optional[nn.Module] = None, tokenizer: Any = None,
                 config: Optional[EngineConfig] = None, verify_model: bool = True, *,
                 core: Optional[EngineCore] = None, mm_encoder: Any = None):
        """An engine over `model` (an mlx-lm model) and its tokenizer, or over a ready `core`. mm_encoder: the
        image path of a vision-language model (pagedmlx/multimodal/loader.py's split_vlm), None: text only."""
        if core is None:
            from pagedmlx.engine.core import EngineCore

            core = EngineCore(model, tokenizer, config, verify_model, mm_encoder=mm_encoder)
        self.core = core
        self.tokenizer = self.core.tokenizer
        self.processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_config(cls, config: EngineConfig, tokenizer: Any = None) -> "LLMEngine":
        """Load config.model (with its own tokenizer, unless one is given) and build the engine."""
        from pagedmlx.engine.core import EngineCore

        return cls(core=EngineCore.from_config(config, tokenizer))

    def __getattr__(self, name: str) -> Any:
        core = self.__dict__.get("core")
        if core is None:
            raise AttributeError(name)
        return getattr(core, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN or hasattr(type(self), name):  # its own, or a patch of one of its methods
            object.__setattr__(self, name, value)
        else:
            setattr(self.core, name, value)

    def encode(self, prompt: PromptType) -> list[int]:
        return self.core.check_prompt(encode_prompt(self.tokenizer, prompt))

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    priority: int = 0, arrival_time: Optional[float] = None,
                    cache_salt: Optional[str] = None, lora_request: Optional[LoRARequest] = None,
                    mm_features: Optional[Sequence[Any]] = None) -> Request:
        """mm_features: the prompt's images (or give `prompt` as a processed multimodal prompt dict)."""
        params = params or SamplingParams()
        ids = encode_prompt(self.tokenizer, prompt)
        mm_features = mm_features or prompt_mm_features(prompt)
        self.processor.add_request(request_id, ids, params)
        try:
            return self.core.add_request(request_id, ids, params, priority, arrival_time, cache_salt, lora_request,
                                         mm_features)
        except BaseException:
            self.processor.forget([request_id])
            raise

    def abort_request(self, request_ids: Iterable[str]) -> list[EngineOutput]:
        return self._outputs(self.core.abort_request(request_ids))

    def step(self) -> list[EngineOutput]:
        """One step of the core (see EngineCore.step); its outputs with their text."""
        return self._outputs(self.core.step())

    def _outputs(self, core_outputs: list[EngineCoreOutput]) -> list[EngineOutput]:
        outputs, to_abort = self.processor.process(core_outputs)
        if to_abort:
            self.core.abort_request(to_abort)  # ended here (a stop string): their outputs are already out
        return outputs
