"""Prompts to token ids for the server: tokenization and chat templating run in a small thread
pool, never on the event loop (a 1 MiB prompt took 0.9-1.8 s to tokenize here, and every other
request, /health included, waited meanwhile), and a text that cannot fit the context is refused
before it is tokenized at all."""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, TypeVar

from pagedmlx.server.protocol import APIError

T = TypeVar("T")

# A normalizer may merge characters (NFC, NFKC), so a token can stand for a little more text than
# its vocabulary entry spells: the length bound keeps this much slack.
NORMALIZER_SLACK = 4


_LONGEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer: Any) -> Optional[int]:
    """The longest vocabulary entry, in characters. Byte-level BPE spells one byte per character and
    SentencePiece one character per character, so no token covers more text than this. Kept per tokenizer:
    `pagedmlx serve` reads it while the engine core starts."""
    try:
        return _LONGEST[tokenizer]
    except (KeyError, TypeError):  # TypeError: a tokenizer that takes no weak reference
        pass
    try:
        longest = max(map(len, tokenizer.get_vocab()))
    except Exception:  # noqa: BLE001 - no vocabulary to read: no cheap bound
        longest = None
    with contextlib.suppress(TypeError):
        _LONGEST[tokenizer] = longest
    return longest


class PromptEncoder:
    def __init__(self, tokenizer: Any, max_model_len: int, workers: Optional[int] = None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        longest = longest_token_chars(tokenizer) if tokenizer is not None else None
        self.max_text_chars = max_model_len * longest * NORMALIZER_SLACK if longest else None
        self._pool = ThreadPoolExecutor(workers or min(4, os.cpu_count() or 1), thread_name_prefix="pagedmlx-tokenize")
        if tokenizer is not None:
            # A fast tokenizer resets its truncation / padding settings on its first encode, a write that
            # fails ("Already borrowed") if another thread encodes at that moment: do it before the pool.
            try:
                tokenizer.encode("warm-up")
            except Exception:  # noqa: BLE001 - its errors show up, per request, later
                pass

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in the pool; its exceptions (APIError) come back to the caller."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_fits(self, text: str, field: str, extra_chars: int = 0) -> None:
        """Refuse, without tokenizing, a text longer than any max_model_len tokens can spell."""
        size = len(text) + extra_chars
        if self.max_text_chars is not None and size > self.max_text_chars:
            raise APIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. However, the {field} "
                f"holds {size} characters, more than {self.max_model_len} tokens of this tokenizer can hold "
                f"(at most {self.max_text_chars}). Please reduce the length of the {field}.",
                param=field, code="context_length_exceeded")

    def encode(self, text: str, field: str) -> list[int]:
        self.check_fits(text, field)
        try:
            return list(self.tokenizer.encode(text))
        except (TypeError, ValueError, UnicodeError) as exc:  # e.g. text the tokenizer cannot take
            raise APIError(400, f"{field}: the tokenizer could not encode it ({type(exc).__name__}: {exc})",
                           param=field) from None

    def check_messages_fit(self, messages: list[dict], extra_chars: int = 0) -> None:
        self.check_fits("".join(_texts(m.get("content")) for m in messages), "messages", extra_chars)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool, extra_chars: int = 0,
                            **kwargs: Any) -> list[int]:
        """`extra_chars`: text the template adds beyond the messages' content (tools, earlier calls);
        `kwargs`: the template's other arguments (tools, chat_template_kwargs)."""
        self.check_messages_fit(messages, extra_chars)
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a template that refuses these messages
            raise APIError(400, f"the chat template failed on these messages: {exc}", param="messages") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)


def _texts(content: Any) -> str:
    """A message's text: its content string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content or [] if isinstance(p, dict))
