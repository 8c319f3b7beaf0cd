"""Incremental detokenization (engine/detokenizer.py): streamed one token at a time, the deltas add up to
exactly what the tokenizer's `decode` gives for the output ids (special tokens skipped), including a
character cut by the end and ids the tiny tokenizer's byte-level BPE cannot finish."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from utils import make_tokenizer

from pagedmlx.engine.detokenizer import IncrementalDetokenizer
from pagedmlx.sampling_params import SamplingParams


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 511), min_size=1, max_size=40), chunks=st.integers(1, 4))
def test_streamed_text_equals_decode(ids, chunks):
    tok = make_tokenizer(512)
    special = set(tok.all_special_ids)
    detok = IncrementalDetokenizer(tok, SamplingParams())
    out = ""
    for i in range(0, len(ids), chunks):
        out += detok.update(ids[i:i + chunks], i + chunks >= len(ids))[0]
    want = tok.decode([t for t in ids if t not in special])
    assert out == want and detok.text == want
