"""ReasoningParser (vLLM's vllm/reasoning): the model's text in, reasoning and content out.

As the tool parsers: one code path for whole responses and streams, text only, a cursor that moves
only as far as the text decides (a partial end marker is held back), so a stream's deltas add up to
exactly the whole response. The content then goes to the tool parser, if the request has one."""

from __future__ import annotations

from typing import Any, Optional

from pagedmlx.server.tool_parsers.abstract_tool_parser import partial_marker


class ReasoningParser:
    skip_special_tokens = True  # False: the markers are special tokens the detokenizer must keep

    def __init__(self, tokenizer: Any = None, request: Any = None, prompt_tail: str = ""):
        """`prompt_tail`: the end of the prompt as text (a template may have closed the reasoning there)."""
        self.model_tokenizer = tokenizer
        self.request = request
        self.prompt_tail = prompt_tail
        kwargs = getattr(request, "chat_template_kwargs", None) or {}
        self.chat_template_kwargs: dict = kwargs if isinstance(kwargs, dict) else {}
        self.text = ""
        self.pos = 0
        self.mode = "start"
        self.reasoning_text = ""
        self.content_text = ""
        self._delta: list[tuple[str, str]] = []

    def extract_reasoning(self, model_output: str, request: Any = None) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a whole response, None where empty."""
        self.extract_reasoning_streaming(model_output, finished=True)
        return self.reasoning_text or None, self.content_text or None

    def extract_reasoning_streaming(self, delta_text: str, finished: bool = False) -> Optional[Any]:
        """The DeltaMessage (reasoning_content, content) this much more text gives; None: nothing yet."""
        from pagedmlx.server.protocol import DeltaMessage

        self.text += delta_text
        self.parse(finished)
        reasoning = "".join(t for kind, t in self._delta if kind == "reasoning") or None
        content = "".join(t for kind, t in self._delta if kind == "content") or None
        self._delta = []
        return DeltaMessage(reasoning_content=reasoning, content=content) if reasoning or content else None

    def parse(self, final: bool) -> None:
        raise NotImplementedError

    def reasoning(self, text: str) -> None:
        if text:
            self._delta.append(("reasoning", text))
            self.reasoning_text += text

    def content(self, text: str) -> None:
        if text:
            self._delta.append(("content", text))
            self.content_text += text

    def emit_until(self, at: int, kind: str) -> None:
        getattr(self, kind)(self.text[self.pos:at])
        self.pos = at

    def emit_held_back(self, markers: tuple[str, ...], final: bool, kind: str) -> None:
        """Everything but an end that may start one of `markers` (all of it when final)."""
        held = 0 if final else partial_marker(self.text, self.pos, markers)
        self.emit_until(len(self.text) - held, kind)
