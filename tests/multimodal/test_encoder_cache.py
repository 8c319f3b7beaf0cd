"""The scheduler's encoder cache accounting (multimodal/encoder_cache.py): the encoder budget cuts a chunk before an
image it cannot encode this step, an image is counted once per step and kept while a request still needs it, and
every image is dropped once no request does."""

from __future__ import annotations

from pagedmlx.multimodal.encoder_cache import EncoderCacheManager
from pagedmlx.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from pagedmlx.request import Request
from pagedmlx.sampling_params import SamplingParams


def feature(name: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec({}, "image", name, PlaceholderRange(offset, length))


def request(rid: str, n: int, *features: MultiModalFeatureSpec) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(), mm_features=features)


def test_the_budget_cuts_a_chunk_before_an_image_it_cannot_encode():
    m = EncoderCacheManager(encoder_budget=10)
    r = request("r", 40, feature("a", 2, 6), feature("b", 12, 6), feature("c", 30, 12))
    m.begin_step()
    assert m.trim(r, 0, 40) == 12  # a (6) fits, b (6 more) does not: the chunk ends before b
    assert m.trim(request("s", 40, feature("a", 0, 6)), 0, 20) == 20  # a is encoded this step already: free
    m.begin_step()
    assert m.trim(r, 12, 28) == 18  # b fits; c (12) exceeds what is left: cut before c
    m.begin_step()
    assert m.trim(r, 30, 10) == 10  # an image larger than the budget goes, alone in its step
    assert m.trim(request("t", 20, feature("d", 5, 2)), 0, 20) == 5


def test_images_stay_while_a_request_needs_them_and_go_after():
    m = EncoderCacheManager(encoder_budget=100)
    r = request("r", 30, feature("a", 2, 6), feature("b", 20, 4))
    s = request("s", 30, feature("a", 10, 6))
    m.begin_step()
    step, freed = m.update([(r, 5), (s, 16)])  # r reaches a's first tokens, s computes its a whole
    assert [f.identifier for f in step["r"]] == ["a"] and [f.identifier for f in step["s"]] == ["a"]
    assert m.cached == {"a": {"r"}} and freed == []
    r.num_computed_tokens = 5
    step, freed = m.update([(r, 20)])  # the rest of a, and b whole
    assert [f.identifier for f in step["r"]] == ["a", "b"] and sorted(freed) == ["a", "b"] and not m.cached
    t = request("t", 30, feature("c", 0, 8))
    m.update([(t, 4)])
    m.free(t)  # preempted or finished half-way: c goes
    assert not m.cached and m.take_freed() == ["c"]
