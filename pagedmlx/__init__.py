"""pagedmlx: a paged-KV inference engine and OpenAI-compatible server for MLX.

`from pagedmlx import LLM, SamplingParams` as from vLLM. The names load lazily, so that importing
the package (or running `pagedmlx --help`) does not import MLX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedmlx.llm",
    "SamplingParams": "pagedmlx.sampling_params",
    "StructuredOutputsParams": "pagedmlx.structured_outputs.params",
    "RequestOutput": "pagedmlx.outputs",
    "CompletionOutput": "pagedmlx.outputs",
    "Logprob": "pagedmlx.outputs",
    "EngineOutput": "pagedmlx.outputs",
    "LLMEngine": "pagedmlx.engine.llm_engine",
    "AsyncEngine": "pagedmlx.engine.async_engine",
    "EngineConfig": "pagedmlx.config",
    "LoRARequest": "pagedmlx.lora.request",
}
__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from pagedmlx.engine.async_engine import AsyncEngine
    from pagedmlx.config import EngineConfig
    from pagedmlx.engine.llm_engine import LLMEngine
    from pagedmlx.llm import LLM
    from pagedmlx.lora.request import LoRARequest
    from pagedmlx.outputs import CompletionOutput, EngineOutput, Logprob, RequestOutput
    from pagedmlx.sampling_params import SamplingParams
    from pagedmlx.structured_outputs.params import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedmlx' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
