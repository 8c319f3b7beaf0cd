"""OutputProcessor (vLLM's name): from the engine core's token ids to EngineOutputs with text.

It runs where the caller is: beside the core in LLMEngine (offline), on the server's event loop in
AsyncEngine, whether the core steps in a thread or in a process of its own. A stop string is found
here, so the request ends here at once; the caller then aborts it in the core, whose later outputs
for it are dropped."""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional, Sequence

from pagedmlx.engine.detokenizer import IncrementalDetokenizer
from pagedmlx.outputs import EngineCoreOutput, EngineOutput, TokenLogprob
from pagedmlx.sampling_params import SamplingParams

logger = logging.getLogger("pagedmlx")


class RequestState:
    """One sequence as the front end knows it: its tokens so far, its text and its logprobs."""

    __slots__ = ("request_id", "prompt_token_ids", "token_ids", "detokenizer", "logprobs", "prompt_logprobs")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer: Any):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self.detokenizer = IncrementalDetokenizer(tokenizer if params.detokenize else None, params)
        self.logprobs: Optional[list[TokenLogprob]] = [] if params.logprobs is not None else None
        self.prompt_logprobs: Optional[list[TokenLogprob]] = None

    def update(self, out: EngineCoreOutput) -> EngineOutput:
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        # the core finishes with "stop" on an EOS or stop token id only (stop strings are found here)
        new_ids, new_lps = out.new_token_ids, out.new_logprobs
        self.token_ids.extend(new_ids)  # before the detokenizer, which may raise on one (then the request fails)
        if len(new_ids) > 1 and self.detokenizer.has_stop_strings:  # accepted drafts (speculative decoding)
            new_ids, new_text, stop = self._update_token_by_token(out)
            del self.token_ids[len(self.token_ids) - len(out.new_token_ids) + len(new_ids):]
            new_lps = new_lps[:len(new_ids)] if new_lps else new_lps
        else:
            new_text, stop = self.detokenizer.update(new_ids, out.finished, out.finish_reason == "stop")
        if stop is not None:  # a stop string ends the request, whatever else ended it this step
            finish_reason, stop_reason = "stop", stop
        if new_lps and self.logprobs is not None:
            self.logprobs.extend(new_lps)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        return EngineOutput(self.request_id, self.prompt_token_ids, self.token_ids, self.detokenizer.text,
                            new_ids, new_text, finish_reason is not None, finish_reason, stop_reason,
                            self.logprobs, new_lps if self.logprobs is not None else None,
                            out.num_cached_tokens, out.error, self.prompt_logprobs)

    def _update_token_by_token(self, out: EngineCoreOutput) -> tuple[list[int], str, Optional[str]]:
        """Several tokens of one step, one at a time: a stop string ends the output at the token that
        completes it, as it would a token a step (the tokens after it are dropped)."""
        ids, text = out.new_token_ids, ""
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            delta, stop = self.detokenizer.update([token], out.finished and last, out.finish_reason == "stop" and last)
            text += delta
            if stop is not None:
                return ids[:i + 1], text, stop
        return ids, text, None

    def failed(self, out: EngineCoreOutput, error: str) -> EngineOutput:
        return EngineOutput(self.request_id, self.prompt_token_ids, self.token_ids, self.detokenizer.text,
                            [], "", True, "error", None, self.logprobs, None, out.num_cached_tokens, error,
                            self.prompt_logprobs)


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Track a request the core has (or is about to have). Raises ValueError for what only the
        front end can refuse: stop strings without a tokenizer, an id in use."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.requests[request_id] = RequestState(request_id, list(prompt_token_ids), params, self.tokenizer)

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def process(self, outputs: Iterable[EngineCoreOutput]) -> tuple[list[EngineOutput], list[str]]:
        """The EngineOutputs of the requests still tracked, and the ids of those that ended here (a stop
        string, a token the detokenizer cannot take) while the core still runs them: the caller aborts
        them in the core. Outputs of requests no longer tracked are dropped."""
        results, to_abort = [], []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue
            try:
                result = state.update(out)
            except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer that cannot decode a token: this request only
                logger.exception("request %s failed in output processing", out.request_id)
                result = state.failed(out, f"{type(exc).__name__}: {exc}")
            if result.finished:
                del self.requests[out.request_id]
                if not out.finished:
                    to_abort.append(out.request_id)
            results.append(result)
        return results, to_abort
