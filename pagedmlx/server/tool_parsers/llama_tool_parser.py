"""llama3_json: Llama 3.1 / 3.2 / 3.3 with JSON tool calls. The whole answer is the calls, each an
object with "parameters" (or "arguments"), separated by ";", after an optional <|python_tag|>:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

Anything else (text first) is content, as vLLM's parser has it."""

from __future__ import annotations

from pagedmlx.server.tool_parsers.abstract_tool_parser import ToolParser


class Llama3JsonToolParser(ToolParser):
    bot_token = "<|python_tag|>"

    def parse(self, final: bool) -> None:
        while not self.raw:
            if self.mode == "text":  # only the start decides: a call, or all content
                if not self.skip_whitespace():
                    if final:
                        self.pos, self.raw = 0, True
                    return
                found = self.at_marker(self.bot_token, final)
                if found is None:
                    return
                if not found and self.text[self.pos] != "{":
                    self.pos, self.raw = 0, True
                    return
                self.call_start, self.mode = 0, "calls"
            elif self.mode == "calls":  # whitespace, then a call's JSON object
                if not self.at_object(final):
                    return
                self.mode = "call"
            elif self.mode == "call":
                if not self.read_call(final, ("parameters", "arguments")):
                    return
                self.mode = "separator"
            else:  # "separator": ";" and another call, or the end
                if not self.skip_whitespace():
                    return
                if self.text[self.pos] != ";":
                    self.call_start = self.pos
                    return self.fail()
                self.pos += 1
                self.call_start, self.mode = self.pos, "calls"
