"""SpeculativeConfig: vLLM's `speculative_config` (`LLM(..., speculative_config={...})`,
`pagedmlx serve --speculative-config '{...}'`). Plain data: EngineConfig crosses a process boundary
pickled (engine/core_proc.py); only an in-process engine may take a loaded draft model object as `model`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional, Union

METHODS = ("ngram", "draft_model", "mtp")
_LATER = {"eagle": "EAGLE", "eagle3": "EAGLE-3",
          "medusa": "Medusa", "mlp_speculator": "an MLP speculator", "suffix": "suffix decoding"}


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: Optional[int] = None  # k: draft tokens proposed per request and step (required)
    # The n-gram matched: the longest of the context's last prompt_lookup_max .. prompt_lookup_min tokens
    # that occurred earlier (vLLM: both default to 5 when neither is given, else each to the other).
    prompt_lookup_max: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    # draft_model / mtp (pagedmlx): also look the context up, and take the n-gram's draft (free: no draft
    # forward) where it promises more tokens per step than the model's (spec_decode/drafter.py). Default:
    # on where prompt_lookup_max or prompt_lookup_min is given. Always on for ngram.
    prompt_lookup: Optional[bool] = None
    # Adaptive (pagedmlx; vLLM v0's disable_by_batch_size): no request speculates while more than this
    # many run (a large batch's step is compute-bound: every rejected draft costs a token's compute), and
    # those steps may overlap again (async scheduling). docs/benchmarks.md, "Speculative decoding".
    disable_by_batch_size: int = 8
    # Adaptive, per request: one whose recent drafts are accepted at less than this rate (accepted / drafted,
    # a moving average) stops proposing for a while, twice as long each time it happens again.
    min_acceptance_rate: float = 0.15
    # draft_model: the draft (an mlx-lm folder, hub name, .gguf or random:<arch>, as the target's `model`;
    # or, in-process only, a loaded mlx-lm model). Same tokenizer as the target (spec_decode/draft_model.py).
    # mtp: the checkpoint folder holding the mtp.* weights (default: the target's own folder; in-process
    # only, a dict of them); the module is the target's (spec_decode/mtp.py).
    model: Any = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            later = _LATER.get(self.method)
            raise ValueError(f"speculative_config.method {self.method!r} is not supported"
                             + (f" yet ({later})" if later else "") + f"; choose one of {', '.join(METHODS)}")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative_config.model is required with method 'draft_model' (the draft model's path)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"speculative_config.model {self.model!r} needs method 'draft_model' (ngram has no model)")
        k = self.num_speculative_tokens
        if k is None:
            raise ValueError("speculative_config.num_speculative_tokens is required (e.g. 4)")
        _int_at_least("num_speculative_tokens", k, 1)
        if k > 32:
            raise ValueError(f"speculative_config.num_speculative_tokens must be <= 32, got {k}")
        given = self.prompt_lookup_min is not None or self.prompt_lookup_max is not None
        if self.prompt_lookup is None:
            self.prompt_lookup = self.method == "ngram" or given
        elif not isinstance(self.prompt_lookup, bool):
            raise ValueError(f"speculative_config.prompt_lookup must be true or false, got {self.prompt_lookup!r}")
        elif self.method == "ngram" and not self.prompt_lookup:
            raise ValueError("speculative_config.prompt_lookup cannot be false with method 'ngram' (prompt lookup "
                             "is the method)")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):  # the ones given, before either fills the other
            if getattr(self, name) is not None:
                _int_at_least(name, getattr(self, name), 1)
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        _int_at_least("disable_by_batch_size", self.disable_by_batch_size, 1)
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"speculative_config.min_acceptance_rate must be a number in [0, 1], got {rate!r}")

    @classmethod
    def from_any(cls, value: Union["SpeculativeConfig", dict, str, None]) -> Optional["SpeculativeConfig"]:
        """A SpeculativeConfig from itself, a dict (vLLM's keys) or its JSON text; None stays None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        return cls(**_vllm_keys(value))


def _vllm_keys(d: dict[str, Any]) -> dict[str, Any]:
    """vLLM's dict: `model: "[ngram]"` (older vLLM) names the method; another model without a method is
    a draft model (vLLM's default for a model that is not EAGLE, MTP or an MLP speculator)."""
    d = dict(d)
    model = d.get("model")
    if isinstance(model, str) and model.strip("[]") == "ngram":
        del d["model"]
        d.setdefault("method", "ngram")
    elif model is not None:
        d.setdefault("method", "draft_model")
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
    return d


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"speculative_config.{name} must be an integer >= {low}, got {value!r}")
