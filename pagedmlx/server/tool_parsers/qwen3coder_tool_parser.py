"""qwen3_coder: the XML-like calls of Qwen3-Coder and Qwen3.5 / 3.6:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's text (one newline stripped at each end) is typed by the tool's JSON Schema, as vLLM's
parser does: integers, numbers, booleans, objects and arrays are converted, the rest stays text. The
arguments stream as each parameter closes: "{", then `"city": "Paris"`, `, "days": 3`, then "}" (the
whole arguments are json.dumps of the parameters)."""

from __future__ import annotations

import ast
import json
import math
from typing import Any, Optional

from pagedmlx.server.tool_parsers.abstract_tool_parser import ToolParser, partial_marker

_INT_TYPES = ("int", "uint", "long", "short", "unsigned")
_TEXT_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def param_type(request: Any, function: str, param: str) -> Optional[str]:
    """The JSON Schema type the request's tool `function` gives `param`, or None."""
    for tool in getattr(request, "tools", None) or []:
        if tool.function.name != function:
            continue
        schema = ((tool.function.parameters or {}).get("properties") or {}).get(param)
        kind = schema.get("type") if isinstance(schema, dict) else None
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), None)
        return kind if isinstance(kind, str) else None
    return None


def convert_param_value(value: str, kind: Optional[str]) -> Any:
    """The parameter's text as its schema type; text where it does not convert."""
    if value.lower() == "null":
        return None
    kind = (kind or "").strip().lower()
    if kind in _TEXT_TYPES or kind == "":
        return value
    try:
        if kind.startswith(_INT_TYPES):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            if not math.isfinite(number):
                return value
            return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
        if kind in ("boolean", "bool", "binary"):
            lowered = value.strip().lower()
            return lowered == "true" if lowered in ("true", "false") else value
        if kind in ("object", "array", "dict", "list"):
            try:
                return json.loads(value)
            except ValueError:
                return ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


class Qwen3CoderToolParser(ToolParser):
    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    function_prefix = "<function="
    function_end = "</function>"
    parameter_prefix = "<parameter="
    parameter_end = "</parameter>"

    def __init__(self, tokenizer: Any = None, request: Any = None):
        super().__init__(tokenizer, request)
        self.function: Optional[str] = None
        self.parameter: Optional[str] = None
        self.num_params = 0
        self._scanned = 0  # a parameter's value holds no end marker before this index

    def parse(self, final: bool) -> None:
        while not self.raw:
            step = getattr(self, f"_mode_{self.mode}")(final)
            if not step:
                return

    def _mode_text(self, final: bool) -> bool:
        found = self.text_until((self.tool_call_start_token, self.function_prefix), final)
        if found is None:
            return False
        self.call_start = self.pos
        if found == self.tool_call_start_token:
            self.pos += len(found)
        self.mode = "open"
        return True

    def _mode_open(self, final: bool) -> bool:  # whitespace, then <function=
        if not self.skip_whitespace():
            return self.fail() if final else False
        found = self.at_marker(self.function_prefix, final)
        if not found:
            return self.fail() if found is False else False
        end = self.text.find(">", self.pos)
        name = self.text[self.pos:end if end != -1 else len(self.text)].strip()
        if end == -1 or not name or "\n" in name or "<" in name:
            if end == -1 and not final and "\n" not in name and "<" not in name:
                self.pos -= len(self.function_prefix)
                return False
            return self.fail()
        self.pos, self.function, self.num_params = end + 1, name, 0
        self.begin_call(name)
        self.arguments("{")
        self.mode = "body"
        return True

    def _mode_body(self, final: bool) -> bool:  # whitespace, then a parameter or </function>
        if not self.skip_whitespace():
            return self._close_function() if final else False
        for marker, mode in ((self.parameter_prefix, "parameter"), (self.function_end, "function_end")):
            found = self.at_marker(marker, final)
            if found is None:
                return False
            if found:
                if mode == "function_end":
                    return self._close_function(tag_seen=True)
                return self._parameter_name(final)
        return self._close_function()  # text that is neither: the call ends here

    def _parameter_name(self, final: bool) -> bool:
        end = self.text.find(">", self.pos)
        name = self.text[self.pos:end if end != -1 else len(self.text)].strip()
        if end == -1 and not final and "\n" not in name:
            self.pos -= len(self.parameter_prefix)
            return False
        if end == -1 or not name or "\n" in name:
            return self.fail()
        self.pos, self.parameter, self._scanned = end + 1, name, end + 1
        self.mode = "value"
        return True

    def _mode_value(self, final: bool) -> bool:
        """The value runs to </parameter>, or (missing) to the next parameter or </function>."""
        markers = (self.parameter_end, self.parameter_prefix, self.function_end)
        found, at = None, len(self.text)
        for marker in markers:
            i = self.text.find(marker, self._scanned)
            if i != -1 and i < at:
                found, at = marker, i
        if found is None and not final:
            self._scanned = max(self.pos, len(self.text) - partial_marker(self.text, self.pos, markers))
            return False
        value = self.text[self.pos:at]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        typed = convert_param_value(value, param_type(self.request, self.function, self.parameter))
        sep = ", " if self.num_params else ""
        self.arguments(f"{sep}{json.dumps(self.parameter, ensure_ascii=False)}: "
                       f"{json.dumps(typed, ensure_ascii=False)}")
        self.num_params += 1
        self.pos = at + len(found) if found == self.parameter_end else at
        self.mode = "body"
        return True

    def _close_function(self, tag_seen: bool = False) -> bool:
        self.arguments("}")
        self.end_call()
        self.mode = "close" if tag_seen else "text"
        return True

    def _mode_close(self, final: bool) -> bool:  # whitespace, then an optional </tool_call>
        self.skip_whitespace()
        if self.at_marker(self.tool_call_end_token, final) is None:
            return False
        self.mode = "text"
        return True
