"""A JSON array of call objects, [{"name": ..., "arguments": {...}}, ...], read into a ToolParser:
Mistral's v3 form, and the output vLLM's tool_choice "required" grammar allows (key "parameters")."""

from __future__ import annotations

from typing import Any


class CallArray:
    def __init__(self, args_keys: tuple[str, ...]):
        self.args_keys = args_keys
        self.state = "open"

    def parse(self, parser: Any, final: bool) -> bool:
        """Move `parser` through the array from its cursor ("[" first); True once it has closed (or
        the text ended after a whole call). False: more text needed, or parser.fail() has run."""
        while not parser.raw:
            if self.state == "open":
                parser.pos += 1
                self.state = "first"
            elif self.state in ("first", "item"):
                if not parser.skip_whitespace():
                    if final:
                        parser.fail()
                    return False
                ch = parser.text[parser.pos]
                if ch == "]" and self.state == "first":
                    parser.pos += 1
                    return True
                if ch != "{":
                    parser.fail()
                    return False
                if self.state == "item":
                    parser.call_start = parser.pos  # a later call that breaks is content from its own start
                self.state = "call"
            elif self.state == "call":
                if not parser.read_call(final, self.args_keys):
                    return False
                self.state = "after"
            else:  # "after": a comma and another call, or the end
                if not parser.skip_whitespace():
                    return final
                ch = parser.text[parser.pos]
                if ch not in ",]":
                    parser.call_start = parser.pos
                    parser.fail()
                    return False
                parser.pos += 1
                if ch == "]":
                    return True
                self.state = "item"
        return False
