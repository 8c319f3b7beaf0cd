"""The OpenAPI document holds for a model that takes images: schema fuzzing of chat completions against a tiny
Gemma 3 (generated image parts: URLs of every shape, details, the string form) finds no 5xx and nothing
undocumented."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from test_server_images import vision_engine
from test_server_openapi import CHECKS, _short
from server_utils import Served

from pagedmlx.server.chat_media import MediaOptions

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402


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
        @settings(max_examples=40, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def one(case) -> None:
            _short(case)
            response = case.call(base_url=served.url, timeout=30)
            statuses[response.status_code] += 1
            try:
                case.validate_response(response, checks=CHECKS)
            except (FailureGroup, AssertionError) as exc:
                failures.append(f"{mode.value}: {exc}"[:2000])

        one()
    assert statuses[400] > 10, statuses
    assert not [s for s in statuses if s >= 500], statuses
    assert not failures, f"{len(failures)} responses outside the document; the first:\n" + "\n".join(failures[:3])
