"""StructuredOutputsParams: what a guided request's output must match (vLLM's class and fields).

Plain data (strings, lists, dicts, bools), so that it crosses a process boundary (pickle, msgspec) with
the SamplingParams that carries it; the engine core compiles it (manager.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Exactly one of json (a JSON Schema, as a dict or its JSON text), regex, choice (a list of strings),
    grammar (Lark, or llama.cpp's GBNF) or json_object (any JSON object). Validated on construction: a
    ValueError names the field (`structured_outputs.json: ...`) when the kinds are not exactly one or
    the grammar does not compile.

    JSON (json, json_object) is compact by default: one line, as json.dumps writes it (`, ` and `: `, no
    other whitespace between tokens), so a model spends no tokens on indentation or runs of newlines.
    disable_any_whitespace=False (vLLM's option; vLLM defaults to free whitespace) or a whitespace_pattern
    allows whitespace between tokens instead."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    # JSON: compact, on one line (vLLM's name). None: compact unless whitespace_pattern is given
    disable_any_whitespace: Optional[bool] = None
    # JSON with whitespace: the whitespace allowed between two tokens, a regex; default: up to 64 of space,
    # tab, CR, LF (vLLM allows any amount: a small model can then loop on newlines until max_tokens)
    whitespace_pattern: Optional[str] = None
    disable_additional_properties: bool = False  # JSON: objects take only the properties the schema names
    structural_tag: Optional[str] = None  # vLLM's; refused: not supported yet

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS[:5])}, got "
                             f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        if kind == "structural_tag":
            raise ValueError("structured_outputs.structural_tag is not supported (json, regex, choice, grammar "
                             "and json_object are)")
        if kind == "json" and isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json must be a JSON Schema (an object or its JSON text): {exc}")
            self.json = parsed
        if kind == "json" and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON Schema object, got {type(self.json).__name__}")
        if kind in ("regex", "grammar") and not (isinstance(getattr(self, kind), str) and getattr(self, kind)):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        if kind == "choice" and not (isinstance(self.choice, (list, tuple)) and self.choice
                                     and all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        if kind == "choice":
            self.choice = list(self.choice)
        if kind == "json_object" and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object!r}")
        from pagedmlx.structured_outputs.backend import validate

        validate(self)

    @property
    def compact_json(self) -> bool:
        """JSON on one line: disable_any_whitespace, else unless a whitespace_pattern is given."""
        return self.whitespace_pattern is None if self.disable_any_whitespace is None else self.disable_any_whitespace

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> Any:
        return getattr(self, self.kind)

    def key(self) -> tuple:
        """What the compiled grammar depends on: the cache key (manager.py)."""
        spec = json.dumps(self.spec, sort_keys=True) if self.kind in ("json", "choice") else self.spec
        return (self.kind, spec, self.compact_json, self.disable_additional_properties,
                self.whitespace_pattern)
