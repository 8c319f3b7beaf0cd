"""The streaming fast path (server/sse.py): a chunk filled into its template is the pydantic model's
own JSON byte for byte, and coalesced outputs carry exactly the tokens and text of the outputs merged."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedmlx.outputs import EngineOutput, TokenLogprob
from pagedmlx.server.protocol import (ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionResponse,
                                      DeltaMessage)
from pagedmlx.server.sse import ChunkTemplate, coalesce, event

STOP_REASONS = st.one_of(st.none(), st.integers(0, 2**31), st.text(min_size=1))
FINISH_REASONS = st.sampled_from([None, "stop", "length", "abort"])


def _chat(**choice) -> ChatCompletionChunk:
    return ChatCompletionChunk(id="chatcmpl-x\"y", model="m/ö", created=1700000000, choices=[ChatChunkChoice(**choice)])


def _completion(**choice) -> CompletionResponse:
    return CompletionResponse(id="cmpl-1", model="a\\b", created=1700000000, choices=[CompletionChoice(**choice)])


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, 63), text=st.text(), finish=FINISH_REASONS, stop=STOP_REASONS)
def test_templates_equal_the_models_json(index, text, finish, stop):
    chat = ChunkTemplate(_chat(index=0, delta=DeltaMessage()))
    expected = _chat(index=index, delta=DeltaMessage(content=text), finish_reason=finish, stop_reason=stop)
    assert chat.render(index, text, finish, stop) == event(expected.model_dump_json())
    completion = ChunkTemplate(_completion(index=0, text=""))
    expected = _completion(index=index, text=text, finish_reason=finish, stop_reason=stop)
    assert completion.render(index, text, finish, stop) == event(expected.model_dump_json())


def _out(rid: str, new_ids: list[int], new_text: str, finish=None, lps=None) -> EngineOutput:
    return EngineOutput(rid, [1, 2], [], "", new_ids, new_text, finish is not None, finish, None, None, lps)


def test_coalesce_merges_each_samples_outputs_in_order():
    lp = [TokenLogprob(5, -0.5, [(5, -0.5)])]
    batch = [(0, _out("a", [5], "x", lps=lp)), (1, _out("b", [7], "p")), (0, _out("a", [6], "y", lps=lp)),
             (0, _out("a", [8], "z", "length", lps=lp))]
    merged = coalesce(batch)
    assert [i for i, _ in merged] == [0, 1]
    a, b = merged[0][1], merged[1][1]
    assert (a.new_token_ids, a.new_text, a.finish_reason, len(a.new_logprobs)) == ([5, 6, 8], "xyz", "length", 3)
    assert (b.new_token_ids, b.new_text, b.finished) == ([7], "p", False)
    assert coalesce([(0, batch[1][1])])[0][1] is batch[1][1]  # one output: as it is


def test_a_template_is_refused_where_a_marker_would_be_ambiguous():
    """Digits of the id are no marker (an index marker once was); a marker is a whole JSON string, so
    only a model name that is exactly one gets no template: its chunks then go through the model."""
    ok = ChunkTemplate.of(ChatCompletionChunk(id="chatcmpl-0123456789", model="m", created=1,
                                              choices=[ChatChunkChoice(index=0, delta=DeltaMessage())]))
    assert ok is not None and b"0123456789" in ok.render(3, "x", None, None)
    assert ChunkTemplate.of(CompletionResponse(id="cmpl-1", model="a\x01text\x01b", created=1,
                                               choices=[CompletionChoice(index=0, text="")])) is not None
    assert ChunkTemplate.of(CompletionResponse(id="cmpl-1", model="\x01text\x01", created=1,
                                               choices=[CompletionChoice(index=0, text="")])) is None
