"""LoRARequest: the adapter a request runs with (vLLM's vllm/lora/request.py)."""

from __future__ import annotations

from typing import Optional

import msgspec


class LoRARequest(msgspec.Struct, omit_defaults=True, array_like=True):
    """An adapter by name, a globally unique id (> 0) and its folder (mlx-lm's adapter_config.json and
    adapters.safetensors). Plain data: it crosses the process boundary with its request. The id keys
    the engine's copy of the adapter and its prefix-cache pages, so one id must always mean one
    adapter (the server numbers the adapters it loads; offline, number them yourself)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"lora_path of adapter {self.lora_name!r} must not be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
