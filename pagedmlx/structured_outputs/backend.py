"""The grammar library's binding: llguidance (chosen over outlines-core and xgrammar for its compile time
and per-step mask cost).

llguidance compiles JSON Schema, regular expressions, Lark / GBNF grammars and choices into a matcher
that computes each step's allowed tokens as a bitmask (one bit per token id, 32 to an int32 word),
consumes sampled tokens, rolls back, and says when the grammar has ended. No torch: its numpy path
fills host arrays; the sampler applies them on the device (sampler.apply_grammar_bitmask)."""

from __future__ import annotations

import threading
from typing import Any, Optional, Protocol, Sequence, Union

import numpy as np


class GrammarParams(Protocol):
    """What this module reads of a StructuredOutputsParams (params.py, which imports this module to
    validate itself: a protocol here, not an import back, keeps the two modules out of a circle)."""

    json: Optional[Union[str, dict]]
    regex: Optional[str]
    choice: Optional[list[str]]
    grammar: Optional[str]
    disable_additional_properties: bool
    whitespace_pattern: Optional[str]

    @property
    def compact_json(self) -> bool: ...

    @property
    def kind(self) -> str: ...


DEFAULT_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,64}"


def _strip_additional_properties(schema: Any) -> Any:
    """disable_additional_properties: every object schema that says nothing takes only its properties."""
    if isinstance(schema, dict):
        out = {k: _strip_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_strip_additional_properties(v) for v in schema]
    return schema


def grammar_text(params: GrammarParams) -> str:
    """llguidance's grammar for the params (what LLMatcher compiles)."""
    import llguidance

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else {"type": "object"}
        if params.disable_additional_properties:
            schema = _strip_additional_properties(schema)
        options: dict[str, Any] = {"whitespace_flexible": not params.compact_json}
        if params.compact_json:  # one line as json.dumps writes it (and chat templates' tojson): ", " and ": "
            options.update(item_separator=", ", key_separator=": ")
        else:
            options["whitespace_pattern"] = params.whitespace_pattern or DEFAULT_WHITESPACE
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", params.choice)
    return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark


def validate(params: GrammarParams) -> None:
    """Compile-check without a tokenizer (milliseconds): a ValueError naming the field if it fails."""
    import llguidance

    field = f"structured_outputs.{params.kind}"
    try:
        grammar = grammar_text(params)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{field} does not compile: {exc}")
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"{field} does not compile: {messages[0] if messages else 'invalid grammar'}")


class GuidanceBackend:
    """One per engine: the tokenizer index (built on first use, in the compile thread: ~0.5 s at
    49k tokens, ~5 s at 262k) and grammar compilation."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)  # mlx-lm's TokenizerWrapper
                self._ll_tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf),
                                                                  eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer

    @property
    def vocab_size(self) -> int:
        return self.ll_tokenizer.vocab_size

    def compile(self, params: GrammarParams) -> Any:
        """A matcher at the grammar's start: the template each request's matcher copies."""
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {matcher.get_error()}")
        return matcher


class GuidanceGrammar:
    """One request's matcher: the tokens it has consumed are the request's output tokens."""

    def __init__(self, matcher: Any):
        self.matcher = matcher
        self.num_processed_tokens = 0

    def accept_token(self, token: int) -> bool:
        ok = self.matcher.consume_token(token)
        self.num_processed_tokens += 1
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)
            self.num_processed_tokens -= num_tokens

    def reset(self) -> None:
        self.matcher.reset()
        self.num_processed_tokens = 0

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed tokens into `row` (a C-contiguous int32 row of ceil(vocab / 32) words)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended (only EOS could follow), or the matcher is in error."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> Optional[str]:
        return self.matcher.get_error() if self.matcher.is_error() else None
