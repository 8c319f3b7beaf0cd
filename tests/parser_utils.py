"""Helpers of the tool call and reasoning parser tests: a parser's whole result, its streamed deltas
accumulated the way the openai SDK does (and checked for OpenAI's shape), and the splits of a text
into deltas that the streamed result must survive."""

from __future__ import annotations

import random
from typing import Callable, Iterator, Optional

from pagedmlx.server.chat_parsing import ChatOutputParser
from utils import ARCHS, make_tokenizer

# (content, reasoning, [(name, arguments)])
Result = tuple[Optional[str], Optional[str], list[tuple[str, str]]]


def whole(make: Callable[[], ChatOutputParser], text: str) -> Result:
    message = make().whole(text)
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    ids = [c.id for c in message.tool_calls or []]
    assert len(set(ids)) == len(ids) and all(ids), ids
    assert message.reasoning == message.reasoning_content
    return message.content or None, message.reasoning_content, calls


def streamed(make: Callable[[], ChatOutputParser], pieces: list[str]) -> Result:
    """The deltas of `pieces` (the last one finishes), accumulated: content and reasoning
    concatenated; per tool call index, the first piece brings id, type and name (arguments ""), the
    later ones only argument fragments (the SDK would otherwise concatenate ids and names)."""
    parser = make()
    content, reasoning, calls = "", "", {}
    for k, piece in enumerate(pieces):
        delta = parser.feed(piece, finished=k == len(pieces) - 1)
        if delta is None:
            continue
        assert delta.content or delta.reasoning_content or delta.tool_calls, delta  # no empty deltas
        assert delta.reasoning == delta.reasoning_content
        content += delta.content or ""
        reasoning += delta.reasoning_content or ""
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.index == len(calls), (call.index, calls)  # indexes in order, from 0
                assert call.id and call.type == "function" and call.function.name, call
                calls[call.index] = [call.function.name, ""]
            else:
                assert call.id is None and call.type is None and call.function.name is None, call
            calls[call.index][1] += call.function.arguments or ""
    return content or None, reasoning or None, [tuple(calls[i]) for i in sorted(calls)]


def splits(text: str, seed: int = 0, pairs_up_to: int = 64, num_cuts: int = 32) -> Iterator[list[str]]:
    """Deltas that may cut anywhere: one piece; every single cut; every pair of cuts (texts of at
    most `pairs_up_to` characters, else every pair among `num_cuts` random cut points); one character
    at a time; and 30 random partitions."""
    n = len(text)
    yield [text]
    for i in range(n + 1):
        yield [text[:i], text[i:]]
    cuts = range(n + 1) if n <= pairs_up_to else sorted(random.Random(seed).sample(range(n + 1), num_cuts))
    for i in cuts:
        for j in cuts:
            if i < j:
                yield [text[:i], text[i:j], text[j:]]
    yield list(text) + [""]
    rng = random.Random(seed)
    for _ in range(30):
        points = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(1, 12)))) if n > 1 else []
        yield [text[a:b] for a, b in zip([0, *points], [*points, n])]


def check_every_split(make: Callable[[], ChatOutputParser], text: str, expected: Result) -> None:
    assert whole(make, text) == expected
    for pieces in splits(text):
        got = streamed(make, pieces)
        assert got == expected, (pieces, got)


class ScriptedSampler:
    """Stands in for the engine core's sampler: the "model" writes a given reply, chosen by the key
    found last in the request's prompt (then EOS); requests with no key keep the model's own tokens.
    The reply goes through the real tokenizer and detokenizer, token by token."""

    def __init__(self, sampler, tokenizer, replies: dict[str, str]):
        self.sampler, self.tokenizer, self.replies = sampler, tokenizer, replies
        self.scripts: dict[str, list[int]] = {}

    def __call__(self, logits, requests, *args, **kwargs):
        import mlx.core as mx

        out = self.sampler(logits, requests, *args, **kwargs)
        ids = out.sampled_token_ids.tolist()
        for i, req in enumerate(requests):
            script = self.scripts.get(req.request_id)
            if script is None:
                prompt = self.tokenizer.decode(req.prompt_token_ids)
                found = max(((prompt.rfind(key), text) for key, text in self.replies.items()), default=(-1, None))
                reply = found[1] if found[0] >= 0 else None
                script = [] if reply is None else [*self.tokenizer.encode(reply), self.tokenizer.eos_token_id]
                self.scripts[req.request_id] = script
            k = len(req.output_token_ids) + req.num_output_placeholders
            if k < len(script):
                ids[i] = script[k]
        out.sampled_token_ids = mx.array(ids, dtype=mx.int32)
        return out


def template_tokenizer(template: str):
    """The tests' tiny tokenizer with another chat template (a copy: the cached one stays as it is)."""
    import copy

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = copy.deepcopy(make_tokenizer(ARCHS["llama"]["vocab_size"])._tokenizer)
    hf.chat_template = template
    return TokenizerWrapper(hf)
