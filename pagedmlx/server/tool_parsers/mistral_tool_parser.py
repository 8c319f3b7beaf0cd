"""mistral: Mistral's [TOOL_CALLS] token, then the calls, in either of its tokenizers' forms:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (v3: Mistral 7B v0.3,
                                                                                    Nemo, Small 3.0)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}     (v11+: Small 3.1 / 3.2,
                                                                                    Magistral, Devstral)

also with no [ARGS] (`get_weather{"city": ...}`, what a detokenizer that drops it leaves) and with a
[CALL_ID]... before [ARGS]. [TOOL_CALLS] is a special token: the detokenizer must keep it. Mistral's
chat templates want tool call ids of 9 letters and digits (vLLM's MistralToolCall), so these ids are."""

from __future__ import annotations

import random
import string

from pagedmlx.server.tool_parsers.abstract_tool_parser import ToolParser
from pagedmlx.server.tool_parsers.array_calls import CallArray

_ALPHANUMERIC = string.ascii_letters + string.digits
_NAME_CHARS = frozenset(_ALPHANUMERIC + "_-.")


def mistral_tool_call_id() -> str:
    return "".join(random.choices(_ALPHANUMERIC, k=9))


class MistralToolParser(ToolParser):
    skip_special_tokens = False
    tool_call_id_factory = staticmethod(mistral_tool_call_id)
    bot_token = "[TOOL_CALLS]"
    args_token = "[ARGS]"
    call_id_token = "[CALL_ID]"

    def parse(self, final: bool) -> None:
        while not self.raw:
            if self.mode == "text":
                if self.text_until((self.bot_token,), final) is None:
                    return
                self.call_start = self.pos
                self.pos += len(self.bot_token)
                self.mode = "calls"
            elif self.mode == "calls":  # a JSON array of calls, one call object, or a name
                if not self.skip_whitespace():
                    if final:
                        self.fail()
                    return
                first = self.text[self.pos]
                self.mode = "array" if first == "[" else "call" if first == "{" else "name"
                self.array = CallArray(("arguments",)) if first == "[" else None
            elif self.mode == "array":
                if not self.array.parse(self, final):
                    return
                self.mode = "text"
            elif self.mode == "call":
                if not self.read_call(final, ("arguments",)):
                    return
                self.mode = "text"
            elif self.mode == "name":
                if not self._name(final):
                    return
            elif self.mode == "call_id":
                at = self.text.find(self.args_token, self.pos)
                if at == -1:
                    return self.fail() if final else None
                self.pos, self.mode = at + len(self.args_token), "arguments"
            else:  # "arguments": the object, as written
                if not self.read_arguments(final):
                    return
                self.mode = "text"

    def _name(self, final: bool) -> bool:
        end = self.pos
        while end < len(self.text) and self.text[end] in _NAME_CHARS:
            end += 1
        rest = self.text[end:end + len(self.call_id_token)]
        if end == len(self.text) or (not final and rest and any(
                m.startswith(rest) and m != rest for m in (self.args_token, self.call_id_token))):
            if final:
                self.fail()
            return False
        name = self.text[self.pos:end]
        if not name:
            self.fail()
            return False
        if rest.startswith(self.args_token):
            self.pos, self.mode = end + len(self.args_token), "arguments"
        elif rest.startswith(self.call_id_token):
            self.pos, self.mode = end + len(self.call_id_token), "call_id"
        elif rest.startswith("{"):
            self.pos, self.mode = end, "arguments"
        else:
            self.fail()
            return False
        self.begin_call(name)
        return True
