"""The OpenAPI document holds for a model that takes images: schema fuzzing of chat completions against a tiny
Gemma 3 (generated image parts: URLs of every shape, details, the string form) finds no 5xx and nothing
undocumented."""

from __future__ import annotations

from collections import Counter

import pytest
from test_server_images import vision_engine
from test_server_openapi import fuzz
from server_utils import Served

from pagedmlx.server.chat_media import MediaOptions

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402


@pytest.fixture(scope="module")
def served():
    engine, processor = vision_engine()
    s = Served(engine, mm_processor=processor, media=MediaOptions())
    yield s
    s.stop()


def test_chat_fuzzing_on_a_vision_model(served):
    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    operation = next(r.ok() for r in schema.get_all_operations() if r.ok().path == "/v1/chat/completions")
    statuses: Counter = Counter()
    failures: list[str] = []

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        fuzz(served.url, operation, mode, 40, statuses, failures)
    assert statuses[400] > 10, statuses
    assert not [s for s in statuses if s >= 500], statuses
    assert not failures, f"{len(failures)} responses outside the document; the first:\n" + "\n".join(failures[:3])
