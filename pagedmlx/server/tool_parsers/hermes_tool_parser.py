"""hermes: Hermes 2 Pro's format, which Qwen2.5 and Qwen3 use: each call a JSON object between tags.

    I'll check the weather.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}
    </tool_call>
"""

from __future__ import annotations

from pagedmlx.server.tool_parsers.abstract_tool_parser import ToolParser


class Hermes2ProToolParser(ToolParser):
    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"

    def parse(self, final: bool) -> None:
        while not self.raw:
            if self.mode == "text":
                if self.text_until((self.tool_call_start_token,), final) is None:
                    return
                self.call_start = self.pos
                self.pos += len(self.tool_call_start_token)
                self.mode = "open"
            elif self.mode == "open":  # whitespace, then the call's JSON object
                if not self.at_object(final):
                    return
                self.mode = "call"
            elif self.mode == "call":
                if not self.read_call(final):
                    return
                self.mode = "close"
            else:  # "close": whitespace, then the end tag (a call without one ends where its JSON ends)
                self.skip_whitespace()
                if self.at_marker(self.tool_call_end_token, final) is None:
                    return
                self.mode = "text"
