"""ServingModels (vLLM's OpenAIServingModels): the base model and the LoRA adapters that requests may
name in `model`, for /v1/models, /v1/load_lora_adapter and /v1/unload_lora_adapter.

The front end keeps the names; the engine core reads and checks each adapter (and keeps its weights)
when it is loaded here, and again from its folder whenever it has dropped it. Each load gets a new
lora_int_id, so that an adapter unloaded and loaded again never meets the pages of the old one."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Optional

from pagedmlx.engine.async_engine import AsyncEngine
from pagedmlx.lora.request import LoRARequest
from pagedmlx.server.protocol import APIError, ModelCard, ModelList


@dataclass
class LoRAModulePath:
    """One `--lora-modules name=path`."""

    name: str
    path: str
    base_model_name: Optional[str] = None

    @classmethod
    def parse(cls, text: str) -> "LoRAModulePath":
        """`name=path` (vLLM's form; its JSON form too: {"name": ..., "path": ..., "base_model_name": ...})."""
        import json

        if text.lstrip().startswith("{"):
            spec = json.loads(text)
            return cls(spec["name"], spec["path"], spec.get("base_model_name"))
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"expected name=path, got {text!r}")
        return cls(name, path)


class ServingModels:
    def __init__(self, engine: AsyncEngine, model_name: str, max_model_len: Optional[int] = None,
                 lora_modules: Optional[list[LoRAModulePath]] = None, aliases: tuple[str, ...] = ()):
        """aliases: other ids a request may send for the base model (responses still say model_name)."""
        self.engine = engine
        self.base_model_name = model_name
        self.aliases = frozenset(aliases) - {model_name}
        self.max_model_len = max_model_len
        self.static_lora_modules = list(lora_modules or [])
        self.lora_requests: dict[str, LoRARequest] = {}  # by name, in loading order
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    @property
    def lora_enabled(self) -> bool:
        return self.engine.info.max_loras > 0

    async def init_static_loras(self) -> None:
        """Load the --lora-modules adapters; ValueError naming the first that fails, and why."""
        for module in self.static_lora_modules:
            try:
                await self.load_lora_adapter(module.name, module.path)
            except APIError as exc:
                raise ValueError(f"--lora-modules {module.name}={module.path}: {exc.message}") from None

    def resolve(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's `model` names (None: the base model); 404 for any other name."""
        if model is None or model == self.base_model_name or model in self.aliases:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            name = model if len(model) <= 200 else model[:200] + "..."
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return lora

    def show_available_models(self) -> ModelList:
        cards = [ModelCard(id=self.base_model_name, max_model_len=self.max_model_len, root=self.base_model_name)]
        cards += [ModelCard(id=lora.lora_name, max_model_len=self.max_model_len, root=lora.lora_path,
                            parent=lora.base_model_name or self.base_model_name)
                  for lora in self.lora_requests.values()]
        return ModelList(data=cards)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> str:
        """vLLM's: 200 with a line of text, or an APIError (400: bad input or an adapter the engine
        cannot serve, with the reason; 404: no adapter in that folder)."""
        if not self.lora_enabled:
            raise APIError(400, "LoRA is not enabled on this server (pagedmlx serve --enable-lora)")
        if not lora_name or not lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        async with self._lock:
            if lora_name in self.lora_requests or lora_name == self.base_model_name or lora_name in self.aliases:
                raise APIError(400, f"The lora adapter '{lora_name}' has already been loaded.", param="lora_name")
            lora = LoRARequest(lora_name, next(self._ids), lora_path, self.base_model_name)
            try:
                await self.engine.add_lora(lora)
            except ValueError as exc:
                missing = "No adapter found" in str(exc)
                raise APIError(404 if missing else 400, str(exc), param="lora_path",
                               code="not_found" if missing else None) from None
            self.lora_requests[lora_name] = lora
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload_lora_adapter(self, lora_name: Optional[str], lora_int_id: Optional[int] = None) -> str:
        """Requests already running with the adapter finish with it; new ones get 404."""
        if not lora_name and not lora_int_id:
            raise APIError(400, "either 'lora_name' or 'lora_int_id' needs to be provided.")
        async with self._lock:
            lora = self.lora_requests.get(lora_name) if lora_name else next(
                (r for r in self.lora_requests.values() if r.lora_int_id == lora_int_id), None)
            if lora is None or (lora_int_id is not None and lora.lora_int_id != lora_int_id):
                raise APIError(404, f"The lora adapter '{lora_name or lora_int_id}' cannot be found.",
                               param="lora_name", code="not_found")
            del self.lora_requests[lora.lora_name]
            await self.engine.remove_lora(lora.lora_int_id)
        return f"Success: LoRA adapter '{lora.lora_name}' removed successfully."
