"""What every request and response model shares: validated text, tagged unions, OpenAI's error shape,
and the log line for request fields the server does not know (ignored, as vLLM does)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Annotated, Any, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

logger = logging.getLogger("pagedmlx.server")


def _valid_unicode(text: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\\ud800"); no tokenizer or UTF-8 encoder takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"must be valid Unicode, but holds a lone UTF-16 surrogate "
                         f"(U+{ord(text[exc.start]):04X}) at position {exc.start}") from None
    return text


# Every string a client sends goes through Text: an encoding error is a 400 naming the field.
Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[Text, Field(min_length=1)]


def _tagged(kind, message: str, **members: Any) -> Any:
    """A union whose member is picked by `kind(value)`: errors then come from that member only."""
    return Annotated[Union[tuple(Annotated[t, Tag(name)] for name, t in members.items())],
                     Discriminator(kind, custom_error_type="union_type", custom_error_message=message)]


def _str_or_list(value: Any) -> Optional[str]:
    return "one" if isinstance(value, str) else "list" if isinstance(value, list) else None


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as vLLM does


class IgnoredFields:
    """One log line per unknown request field name, again at most every `interval` seconds; at most
    `max_names` names are remembered (a client sending random names gets one summary line instead)."""

    def __init__(self, interval: float = 600.0, max_names: int = 256):
        self.interval, self.max_names = interval, max_names
        self._last: dict[str, float] = {}
        self._overflow_logged = -float("inf")
        self._lock = threading.Lock()

    def note(self, kind: str, names: set[str]) -> None:
        now = time.monotonic()
        fresh, overflow = [], False
        with self._lock:
            for name in sorted(names):
                if name not in self._last and len(self._last) >= self.max_names:
                    overflow = True
                elif now - self._last.get(name, -float("inf")) >= self.interval:
                    self._last[name] = now
                    fresh.append(name)
            overflow = overflow and now - self._overflow_logged >= self.interval
            if overflow:
                self._overflow_logged = now
        for name in fresh:
            logger.warning("%s: the field %r is not supported and was ignored", kind, name[:100])
        if overflow:
            logger.warning("%s: more unknown fields were ignored (no longer logged one by one)", kind)


IGNORED_FIELDS = IgnoredFields()


class RequestModel(OpenAIModel):
    """A request body: its unknown top-level fields are ignored and logged (IGNORED_FIELDS)."""

    @model_validator(mode="before")
    @classmethod
    def _note_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = {k for k in data if isinstance(k, str) and k not in _field_names(cls)}
            if unknown:
                IGNORED_FIELDS.note(cls.__name__, unknown)
        return data


_NAMES: dict[type, frozenset[str]] = {}


def _field_names(cls: type[BaseModel]) -> frozenset[str]:
    names = _NAMES.get(cls)
    if names is None:
        names = frozenset(n for name, f in cls.model_fields.items() for n in (name, f.alias) if n)
        _NAMES[cls] = names
    return names


# ---- errors ----------------------------------------------------------------------------------

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error the API answers with its status and OpenAI's error shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[Union[str, int]] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers
        self.code = code if code is not None else status

    def response_body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()
