"""The OpenAPI document says what the server does: a short, bounded schema-fuzzing run
(Schemathesis, valid and invalid requests generated from the app's own /openapi.json) must find no
5xx and no response outside the document: status, content type, headers and body schema.

Before: the document listed 200 and 422 only (the server answers 400), no 404/413/429/503, no
event stream, no field limits; 469 of 549 fuzzed responses had an undocumented status."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from server_utils import Served, make_engine

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, response_headers_conformance,  # noqa: E402
                                               response_schema_conformance, status_code_conformance)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
EXAMPLES = {"POST": 30, "GET": 4, "HEAD": 2}  # per operation and generation mode: about 8 s here


@pytest.fixture(scope="module")
def served():
    s = Served(make_engine(), api_key=None)
    yield s
    s.stop()


def _short(case) -> None:
    """Keep generation short (the model is slow on a CPU); invalid values are left as generated."""
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and body[key] > 4:
                body[key] = 4
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 4


def test_document_lists_what_the_server_answers(served):
    import httpx

    doc = httpx.get(served.url + "/openapi.json").json()
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert set(completions) == {"200", "400", "404", "408", "413", "429", "500", "503"}
    assert "text/event-stream" in completions["200"]["content"]
    assert completions["503"]["headers"]["Retry-After"]["required"]
    assert "head" in doc["paths"]["/health"]
    request = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["n"]["maximum"] == 4 and request["temperature"]["anyOf"][0]["maximum"] == 100
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_document_lists_tool_calling_and_reasoning(served):
    import httpx

    schemas = httpx.get(served.url + "/openapi.json").json()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "include_reasoning"} <= set(chat)
    choice = chat["tool_choice"]["anyOf"][0]["oneOf"]
    assert choice[0]["enum"] == ["none", "auto", "required"]
    assert choice[1]["$ref"].endswith("/ChatCompletionNamedToolChoiceParam")
    message = schemas["ChatMessage"]["properties"]
    assert {"tool_call_id", "tool_calls", "reasoning_content"} <= set(message)
    for name in ("AssistantMessage", "DeltaMessage"):
        assert {"reasoning_content", "reasoning", "tool_calls"} <= set(schemas[name]["properties"]), name
    assert set(schemas["DeltaToolCall"]["properties"]) == {"index", "id", "type", "function"}
    assert schemas["FunctionDefinition"]["properties"]["name"]["pattern"] == "^[A-Za-z0-9_.-]{1,64}$"


def fuzz(url: str, operation, mode: GenerationMode, examples: int, statuses: Counter, failures: list[str]) -> None:
    """`examples` generated cases of `operation` against the server at `url`: each response's status counted, and
    each one outside the document kept in `failures` (collected, so that one run reports them all)."""
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case) -> None:
        _short(case)
        response = case.call(base_url=url, timeout=30)
        statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (FailureGroup, AssertionError) as exc:
            failures.append(f"{operation.label} {mode.value}: {exc}"[:2000])

    one()


def test_schema_fuzzing_finds_no_5xx_and_nothing_undocumented(served):
    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    statuses: Counter = Counter()
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        method = operation.method.upper()
        fuzz(served.url, operation, GenerationMode.POSITIVE, EXAMPLES[method], statuses, failures)
        if method == "POST":  # only bodies can be made invalid: the other routes take no input
            fuzz(served.url, operation, GenerationMode.NEGATIVE, EXAMPLES[method], statuses, failures)
    assert sum(statuses.values()) > 100 and statuses[200] > 20 and statuses[400] > 20, statuses
    assert not [s for s in statuses if s >= 500], statuses
    assert not failures, f"{len(failures)} responses outside the document; the first:\n" + "\n".join(failures[:3])
