"""Incremental detokenization with stop strings.

Text is produced token by token: by the `tokenizers` library's DecodeStream where the tokenizer is a
Hugging Face fast tokenizer (Rust, about a microsecond a token; the text is exactly what `decode`
gives for the output ids, as in vLLM), else by mlx-lm's streaming detokenizer. (mlx-lm's own Python
detokenizers cost tens of microseconds a token, and building its BPE one reads the whole vocabulary:
too much for a server's front end at thousands of tokens a second.)

A stop string may be split across tokens, so the last (longest stop string - 1) characters are held
back until the next token shows whether they start a stop string; on a match the text is cut before
the stop string (or after it, with include_stop_str_in_output).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from pagedmlx.sampling_params import SamplingParams


class _FastStream:
    """mlx-lm's streaming detokenizer interface (add_token, finalize, text) over DecodeStream."""

    def __init__(self, backend: Any):
        from tokenizers.decoders import DecodeStream

        self._backend, self._decoder, self._parts = backend, DecodeStream(skip_special_tokens=False), []
        self._ids: list[int] = []

    def add_token(self, token_id: int) -> None:
        self._ids.append(token_id)
        piece = self._decoder.step(self._backend, token_id)
        if piece:
            self._parts.append(piece)

    def finalize(self) -> None:
        """Bytes DecodeStream still holds (a character cut by the end) come out as `decode` gives them."""
        text, full = self.text, self._backend.decode(self._ids, skip_special_tokens=False)
        self._parts = [text + full[len(text):]] if full.startswith(text) else [full]

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""


def _stream(tokenizer: Any) -> Any:
    backend = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "backend_tokenizer", None)
    return _FastStream(backend) if backend is not None else tokenizer.detokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams):
        self._stream = _stream(tokenizer) if tokenizer is not None else None
        special = getattr(tokenizer, "all_special_ids", None) or []
        self._skip_ids = set(special) if params.skip_special_tokens else set()
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        # the token ids that end a request in the core (Scheduler._check_stop)
        self._stop_ids = set(getattr(tokenizer, "eos_token_ids", None) or ()) | set(params.stop_token_ids)
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self._num_emitted = 0
        self._num_searched = 0  # text before this index holds no stop string

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stops) and self._stream is not None

    def update(self, new_token_ids: Sequence[int], finished: bool,
               stop_terminated: bool = False) -> tuple[str, Optional[str]]:
        """Add tokens; return (text newly ready for the caller, the stop string matched or None).
        `stop_terminated`: the core ended the request with "stop"; where its last token is an EOS or
        stop token id, that token's text is left out, as vLLM (unless include_stop_str_in_output),
        special token or not (skip_special_tokens=False would show an EOS's text)."""
        if self._stream is None:
            return "", None
        if stop_terminated and not self._include_stop and new_token_ids and new_token_ids[-1] in self._stop_ids:
            new_token_ids = new_token_ids[:-1]
        for t in new_token_ids:
            if t not in self._skip_ids:
                self._stream.add_token(t)
        if finished:
            self._stream.finalize()
        text = self._stream.text
        stop = None
        if self._stops:
            text, stop = self._find_stop(text)
        self.text = text
        if finished or stop is not None:
            ready = len(text)
        else:
            ready = max(self._num_emitted, len(text) - self._holdback)
        delta = text[self._num_emitted:ready]
        self._num_emitted = ready
        return delta, stop

    def _find_stop(self, text: str) -> tuple[str, Optional[str]]:
        start = max(0, self._num_searched - self._holdback)
        best, best_at = None, len(text)
        for s in self._stops:
            at = text.find(s, start)
            if at != -1 and at < best_at:
                best, best_at = s, at
        self._num_searched = len(text)
        if best is None:
            return text, None
        end = best_at + len(best) if self._include_stop else best_at
        return text[:end], best
