"""JSON read a character at a time, for tool calls that stream.

JsonScanner checks one value's syntax as it arrives: the first character that cannot continue valid
JSON raises ValueError, so a parser takes the same decision at the same character however the text
was split into deltas. ArgumentsReader and CallReader sit on it: the arguments object of a call as
the model wrote it, and a whole call object {"name": ..., "arguments": {...}}.

Leniency, where models slip: a raw control character (a newline) inside a string is taken, and the
arguments text that comes out carries it escaped, so that it still parses."""

from __future__ import annotations

import json
import re
from typing import Optional

WHITESPACE = " \t\r\n"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_STRING_SPECIAL = re.compile(r'["\\\x00-\x1f]')  # what ends a run of plain characters inside a string
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = ("true", "false", "null")
# what the scanner expects next
VALUE, FIRST_KEY, KEY, COLON, AFTER, FIRST_ITEM, STRING, ESCAPE, UNICODE, NUMBER, LITERAL, DONE = range(12)
KEY_END, STRING_END = 1, 2  # feed()'s events: a depth-1 key or string value closed (its text: .string)


class JsonScanner:
    def __init__(self) -> None:
        self.stack: list[str] = []  # the open containers, "{" or "["
        self.state = VALUE
        self.done = False
        self.string: Optional[str] = None  # the last depth-1 key or string value, decoded
        self._is_key = False
        self._raw: Optional[str] = None  # a depth-1 string's text so far, quotes included
        self._token = ""  # a number's or literal's characters so far
        self._hex = 0

    @property
    def depth(self) -> int:
        return len(self.stack)

    def plain_run(self, text: str, start: int) -> int:
        """Inside a string, take the plain characters from `start` on at once (the common case, and
        the long one: code in an argument); the index of the first one left for feed()."""
        if self.state != STRING:
            return start
        match = _STRING_SPECIAL.search(text, start)
        end = match.start() if match else len(text)
        if self._raw is not None:
            self._raw += text[start:end]
        return end

    def feed(self, ch: str) -> int:
        """Take one character: KEY_END or STRING_END when it closes a depth-1 key or string, else 0."""
        state = self.state
        if state == STRING:
            if self._raw is not None:
                self._raw += ch
            if ch == '"':
                return self._end_string()
            if ch == "\\":
                self.state = ESCAPE
            return 0
        if state in (ESCAPE, UNICODE):
            return self._escape(ch)
        if state == NUMBER:
            if ch in _NUMBER_CHARS:
                self._token += ch
                return 0
            if not _NUMBER.fullmatch(self._token):
                raise ValueError(f"not a JSON number: {self._token!r}")
            self._value_done()
            return self.feed(ch)
        if state == LITERAL:
            self._token += ch
            if not any(word.startswith(self._token) for word in _LITERALS):
                raise ValueError(f"not a JSON literal: {self._token!r}")
            if self._token in _LITERALS:
                self._value_done()
            return 0
        if ch in WHITESPACE:
            return 0
        return self._structural(state, ch)

    def _structural(self, state: int, ch: str) -> int:
        if state == FIRST_ITEM and ch == "]" or state == FIRST_KEY and ch == "}":
            self.stack.pop()
            self._value_done()
        elif state in (VALUE, FIRST_ITEM):
            self._begin_value(ch)
        elif state in (FIRST_KEY, KEY) and ch == '"':
            self._begin_string(is_key=True)
        elif state == COLON and ch == ":":
            self.state = VALUE
        elif state == AFTER and ch == ",":
            self.state = KEY if self.stack[-1] == "{" else VALUE
        elif state == AFTER and ch == ("}" if self.stack[-1] == "{" else "]"):
            self.stack.pop()
            self._value_done()
        else:
            where = "after the end of the value" if state == DONE else "here"
            raise ValueError(f"unexpected {ch!r} {where}")
        return 0

    def _begin_value(self, ch: str) -> None:
        if ch in "{[":
            self.stack.append(ch)
            self.state = FIRST_KEY if ch == "{" else FIRST_ITEM
        elif ch == '"':
            self._begin_string(is_key=False)
        elif ch == "-" or "0" <= ch <= "9":
            self.state, self._token = NUMBER, ch
        elif ch in "tfn":
            self.state, self._token = LITERAL, ch
        else:
            raise ValueError(f"a JSON value cannot start with {ch!r}")

    def _begin_string(self, is_key: bool) -> None:
        self._is_key, self.state = is_key, STRING
        self._raw = '"' if self.depth == 1 else None

    def _end_string(self) -> int:
        raw, self._raw = self._raw, None
        if self._is_key:
            self.state = COLON
        else:
            self._value_done()
        if raw is None:
            return 0
        self.string = json.loads(raw, strict=False)
        return KEY_END if self._is_key else STRING_END

    def _escape(self, ch: str) -> int:
        if self._raw is not None:
            self._raw += ch
        if self.state == UNICODE:
            if ch not in _HEX:
                raise ValueError(f"bad \\u escape character {ch!r}")
            self._hex -= 1
            if self._hex == 0:
                self.state = STRING
        elif ch == "u":
            self.state, self._hex = UNICODE, 4
        elif ch in '"\\/bfnrt':
            self.state = STRING
        else:
            raise ValueError(f"bad escape \\{ch}")
        return 0

    def _value_done(self) -> None:
        if self.stack:
            self.state = AFTER
        else:
            self.state, self.done = DONE, True


def _out(scanner: JsonScanner, ch: str) -> str:
    """`ch` as it goes into arguments text: a raw control character inside a string escaped."""
    return json.dumps(ch)[1:-1] if ch < " " and scanner.state == STRING else ch


class ArgumentsReader:
    """An arguments object, a character at a time; `text` is what has been read, as written."""

    def __init__(self) -> None:
        self.scanner = JsonScanner()
        self.text = ""

    @property
    def done(self) -> bool:
        return self.scanner.done

    def feed_run(self, text: str, start: int) -> int:
        end = self.scanner.plain_run(text, start)
        self.text += text[start:end]
        return end

    def feed(self, ch: str) -> None:
        if self.scanner.depth == 0 and ch != "{" and ch not in WHITESPACE:
            raise ValueError(f"the arguments must be a JSON object, not start with {ch!r}")
        out = _out(self.scanner, ch)
        self.scanner.feed(ch)
        if self.text or ch not in WHITESPACE:
            self.text += out


class CallReader:
    """One call object, a character at a time: {"name": "f", "arguments": {...}}. The arguments may
    come under another of `args_keys` ("parameters": Llama 3, vLLM's tool_choice "required"), or as a
    JSON string holding the object; other keys are skipped. `name` once its string has closed;
    `arguments`: the arguments object's text so far (a string's, once it has closed)."""

    def __init__(self, args_keys: tuple[str, ...] = ("arguments", "parameters")):
        self.scanner = JsonScanner()
        self.args_keys = args_keys
        self.key: Optional[str] = None
        self.name: Optional[str] = None
        self.arguments = ""
        self.args_done = False

    @property
    def done(self) -> bool:
        return self.scanner.done

    def feed_run(self, text: str, start: int) -> int:
        """feed() for a run of plain string characters from `start`; the index after them."""
        sc = self.scanner
        end = sc.plain_run(text, start)
        if end > start and len(sc.stack) >= 2 and self.key in self.args_keys and not self.args_done:
            self.arguments += text[start:end]
        return end

    def feed(self, ch: str) -> None:
        sc = self.scanner
        depth = sc.depth
        in_args = self.key in self.args_keys and not self.args_done
        if depth == 1 and sc.state == VALUE and ch not in WHITESPACE:
            if in_args and ch not in '{"':
                raise ValueError(f"{self.key} must be a JSON object, not start with {ch!r}")
            if self.key == "name" and ch != '"':
                raise ValueError(f"name must be a string, not start with {ch!r}")
        out = _out(sc, ch)
        event = sc.feed(ch)
        if event == KEY_END:
            self.key = sc.string
        elif event == STRING_END and self.key == "name" and self.name is None:
            self.name = sc.string
        elif event == STRING_END and in_args:
            self._string_arguments(sc.string)
        elif in_args and (depth >= 2 or sc.depth >= 2):
            self.arguments += out
            self.args_done = sc.depth == 1

    def _string_arguments(self, text: str) -> None:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"{self.key}, given as a string, must hold a JSON object")
        self.arguments, self.args_done = text, True

    def finish(self) -> str:
        """The call is complete: its arguments ("{}" when it had none). ValueError without a name."""
        if not self.name:
            raise ValueError("a tool call without a name")
        if not self.arguments:
            self.arguments, self.args_done = "{}", True
        return self.arguments
