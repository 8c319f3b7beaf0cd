"""Guided decoding (structured outputs): every guided output parses and validates, guided
rows batched with unguided ones leave those equal to mlx-lm's solo tokens, a guided request's tokens
do not depend on the batch (busy == alone), through preemption and async scheduling; grammars compile
off the step loop; the server's response_format / structured_outputs / guided_* fields and the openai
SDK's parse()."""

from __future__ import annotations

import json
import pickle
import re
import threading
import time

import jsonschema
import pytest
from utils import (ARCHS, assert_no_leaks, assert_solo_greedy, make_model, make_prompts, make_tokenizer, solo_greedy,
                   run_to_completion)

from pagedmlx import LLM, SamplingParams, StructuredOutputsParams
from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.structured_outputs import backend as so_backend

VOCAB = ARCHS["llama"]["vocab_size"]

# Bounded schemas: a random-weight model takes whatever the mask allows, so every string, array and
# number has an end it must reach.
SCHEMAS = {
    "required": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "nick": {"type": "string", "maxLength": 3}},
        "required": ["name", "age"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"enum": [1, 2, 3]}},
             "required": ["color", "size"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}, "minItems": 1, "maxItems": 4},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "tags": {"type": "array", "maxItems": 2,
                                                           "items": {"type": "string", "maxLength": 4}}},
                 "required": ["id", "tags"], "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"n": {"type": "integer", "minimum": -50, "maximum": 50},
                                                 "b": {"type": "boolean"}, "z": {"type": "null"}},
                "required": ["n", "b", "z"], "additionalProperties": False},
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICE = ["yes", "no", "maybe so"]


def guided(**kind) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kind, disable_any_whitespace="json" in kind)


def kinds() -> list[tuple[str, StructuredOutputsParams]]:
    return ([(name, guided(json=s)) for name, s in SCHEMAS.items()]
            + [("regex", guided(regex=REGEX)), ("choice", guided(choice=CHOICE))])


def check_output(name: str, text: str) -> None:
    """The output matches its grammar: the schema validates, the regex or a choice matches whole."""
    if name == "regex":
        assert re.fullmatch(REGEX, text), text
    elif name == "choice":
        assert text in CHOICE, text
    else:
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def tiny_engine(**kw) -> LLMEngine:
    cfg = dict(block_size=4, num_blocks=256, max_model_len=512, max_num_batched_tokens=96, max_num_seqs=32)
    cfg.update(kw)
    return LLMEngine(make_model("llama"), make_tokenizer(VOCAB), EngineConfig(**cfg))


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    return run_to_completion(engine)


# ---- parameters -----------------------------------------------------------------------------------

def test_params_validate_and_are_plain_data():
    assert StructuredOutputsParams(json='{"type": "object"}').json == {"type": "object"}
    with pytest.raises(ValueError, match="exactly one of .* got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of .* got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match=r"^structured_outputs.json does not compile"):
        StructuredOutputsParams(json={"type": "objec"})
    with pytest.raises(ValueError, match=r"^structured_outputs.json must be a JSON Schema"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match=r"^structured_outputs.regex does not compile"):
        StructuredOutputsParams(regex="(")
    with pytest.raises(ValueError, match=r"^structured_outputs.grammar does not compile"):
        StructuredOutputsParams(grammar="start: (")
    with pytest.raises(ValueError, match=r"^structured_outputs.choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match=r"^structured_outputs.structural_tag is not supported"):
        StructuredOutputsParams(structural_tag='{"structures": []}')
    with pytest.raises(ValueError, match="uniqueItems"):  # llguidance refuses what it cannot enforce
        StructuredOutputsParams(json={"type": "array", "uniqueItems": True})
    with pytest.raises(ValueError, match="^structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        json=SCHEMAS["nested"], disable_additional_properties=True))
    copy = pickle.loads(pickle.dumps(params))  # crosses a process boundary as plain data
    assert copy == params and copy.structured_outputs.key() == params.structured_outputs.key()
    assert json.dumps(vars(copy.structured_outputs))  # dicts, strings, bools only


# ---- the engine on a random-weight model --------------------------------------------------------------

def test_guided_batched_with_unguided_valid_and_unguided_equal_mlx_lm():
    """Guided requests of every kind, greedy and seeded, in one busy engine with 24 unguided greedy
    requests: every guided output validates and ends with "stop"; every unguided one equals mlx-lm's
    solo generation; each guided one equals the same request alone in an engine of its own."""
    model = make_model("llama")
    prompts = make_prompts(24, VOCAB, seed=11)
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reqs = [(f"u{i}", p, plain) for i, p in enumerate(prompts)]
    guided_reqs = []
    for j, (name, so) in enumerate(kinds() * 2):
        sampling = dict(temperature=0) if j < len(SCHEMAS) + 2 else dict(temperature=1.0, seed=j)
        guided_reqs.append((f"g{j}-{name}", prompts[j % 7][:20 + j],
                            SamplingParams(max_tokens=120, structured_outputs=so, **sampling)))
    engine = tiny_engine()
    done = run(engine, reqs[:12] + guided_reqs + reqs[12:])
    for rid, prompt, _ in reqs:
        assert_solo_greedy(done[rid].token_ids, model, prompt, 10, rid)
    for rid, prompt, params in guided_reqs:
        out = done[rid]
        assert out.finish_reason == "stop", (rid, out.text, out.finish_reason)
        check_output(rid.split("-", 1)[1], out.text)
        alone = run(tiny_engine(), [(rid, prompt, params)])[rid]
        assert alone.token_ids == out.token_ids, rid
    assert engine.structured_output_manager.num_compiles == len(kinds())  # cached by schema
    assert not engine.structured_output_manager._pending
    assert_no_leaks(engine)


@pytest.mark.parametrize("overlap", [True, "early"])
def test_async_scheduling_with_guided_rows(overlap, monkeypatch):
    """Steps overlap while only unguided requests run; a guided row's mask needs its previous token,
    so steps with guided rows do not overlap; outputs as without async scheduling."""
    if overlap == "early":
        from pagedmlx.runner.model import ModelRunner

        monkeypatch.setattr(ModelRunner, "pages_in_place", property(lambda self: True))
    prompts = make_prompts(8, VOCAB, seed=5)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reqs = [(f"u{i}", p, plain) for i, p in enumerate(prompts)]
    reqs += [(f"g{j}-{name}", prompts[j][:16], SamplingParams(temperature=0, max_tokens=100, structured_outputs=so))
             for j, (name, so) in enumerate(kinds())]
    sync = run(tiny_engine(), reqs)
    engine = tiny_engine(async_scheduling=True)
    for rid, prompt, params in reqs[:8]:  # unguided first: those steps overlap
        engine.add_request(rid, prompt, params)
    done = {o.request_id: o for _ in range(3) for o in engine.step() if o.finished}
    assert engine.stats.num_overlapped > 0
    done.update(run(engine, reqs[8:]))
    for rid, _, _ in reqs:
        assert done[rid].token_ids == sync[rid].token_ids, rid
        if rid.startswith("g"):
            check_output(rid.split("-", 1)[1], done[rid].text)
    assert_no_leaks(engine)


def test_preemption_mid_guided_output(monkeypatch):
    """A pool too small for all: guided requests are preempted after some output tokens and
    recomputed; their matchers stay in step with their tokens, outputs equal each alone."""
    from pagedmlx.core.sched.scheduler import Scheduler

    preempted = []
    real = Scheduler._preempt

    def spy(self, request):
        preempted.append((request.request_id, request.num_output_tokens))
        real(self, request)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    prompts = make_prompts(10, VOCAB, seed=9)
    reqs = [(f"g{j}-{name}", prompts[j][:30], SamplingParams(temperature=0, max_tokens=100, structured_outputs=so))
            for j, (name, so) in enumerate(kinds())]
    reqs += [(f"u{i}", p[:40], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
             for i, p in enumerate(prompts[:4])]
    engine = tiny_engine(num_blocks=40, max_model_len=160)
    done = run(engine, reqs)
    assert any(rid.startswith("g") and n > 0 for rid, n in preempted), preempted
    for rid, prompt, params in reqs:
        alone = run(tiny_engine(), [(rid, prompt, params)])[rid]
        assert done[rid].token_ids == alone.token_ids, rid
        if rid.startswith("g"):
            check_output(rid.split("-", 1)[1], done[rid].text)
    assert_no_leaks(engine)


def test_grammar_compiles_off_the_step_loop(monkeypatch):
    """While a new grammar compiles (held back here until released), its request waits and the
    others step on."""
    gate = threading.Event()
    real = so_backend.GuidanceBackend.compile

    def slow(self, params):
        gate.wait(10)
        return real(self, params)

    monkeypatch.setattr(so_backend.GuidanceBackend, "compile", slow)
    engine = tiny_engine()
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("g", [5, 6, 7], SamplingParams(temperature=0, max_tokens=50,
                                                       structured_outputs=guided(choice=CHOICE)))
    engine.add_request("u", [1, 2, 3], plain)
    outs = []
    while not any(o.finished for o in outs):
        outs += engine.step()
    assert {o.request_id for o in outs} == {"u"}  # "u" ran to its end
    assert engine.scheduler.requests["g"].num_computed_tokens == 0
    gate.set()
    done = run(engine, [])
    assert done["g"].text in CHOICE and done["g"].finish_reason == "stop"
    assert_no_leaks(engine)


def test_grammar_that_fails_in_the_engine_finishes_with_error(monkeypatch):
    def broken(self, params):
        raise ValueError("structured_outputs.regex does not compile: boom")

    monkeypatch.setattr(so_backend.GuidanceBackend, "compile", broken)
    engine = tiny_engine()
    done = run(engine, [("g", [5, 6], SamplingParams(max_tokens=5, structured_outputs=guided(regex="a+"))),
                        ("u", [1, 2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))])
    assert done["g"].finish_reason == "error" and "boom" in done["g"].error
    assert done["u"].finish_reason == "length"
    assert_no_leaks(engine)


def test_abort_and_finish_free_the_matcher():
    engine = tiny_engine()
    req = engine.add_request("g", [5, 6, 7], SamplingParams(temperature=0, max_tokens=100,
                                                            structured_outputs=guided(json=SCHEMAS["nested"])))
    while not req.output_token_ids:
        engine.step()
    assert req.structured_output_request.grammar.num_processed_tokens == len(req.output_token_ids)
    out = engine.abort_request(["g"])[0]
    assert out.finish_reason == "abort" and req.structured_output_request is None
    assert_no_leaks(engine)
    done = run(engine, [("c", [1], SamplingParams(temperature=0, max_tokens=50,
                                                  structured_outputs=guided(choice=CHOICE)))])
    assert done["c"].finish_reason == "stop"
    assert_no_leaks(engine)


def test_grammar_end_stops_like_eos_even_with_ignore_eos():
    """The grammar's end finishes the request ("stop"), without a token beyond it."""
    llm = LLM.from_engine(tiny_engine())
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, structured_outputs=guided(choice=["ab"]))
    out = llm.generate([[3, 4]], params)[0].outputs[0]
    assert out.text == "ab" and out.finish_reason == "stop"
    assert llm.tokenizer.decode(out.token_ids) == "ab"


def test_matcher_resyncs_by_rollback_and_catch_up():
    """A matcher that holds more or fewer tokens than its request's output is brought back to exactly
    the output: its next mask equals a fresh matcher's after those tokens."""
    import numpy as np

    from pagedmlx.request import Request
    from pagedmlx.structured_outputs.manager import StructuredOutputManager

    tok = make_tokenizer(VOCAB)
    manager = StructuredOutputManager(tok, tok.eos_token_ids)
    params = SamplingParams(structured_outputs=guided(json=SCHEMAS["enum"]))
    text = tok.encode('{"color":"green","size":2}', add_special_tokens=False)

    def mask_after(tokens, consumed):
        req = Request("r", [1], params)
        manager.add_request(req)
        req.structured_output_request._future.result()
        for t in consumed:
            req.structured_output_request.accept(t)
        req.output_token_ids = list(tokens)
        return manager.grammar_bitmask([req]).words[0], req.structured_output_request.grammar

    want, _ = mask_after(text[:5], text[:5])
    for consumed in (text[:8], text[:2], []):
        got, grammar = mask_after(text[:5], consumed)
        assert np.array_equal(got, want) and grammar.num_processed_tokens == 5
    assert not np.array_equal(mask_after(text[:2], text[:2])[0], want)


def test_n_samples_each_have_their_own_matcher():
    llm = LLM.from_engine(tiny_engine())
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=100,
                            structured_outputs=guided(json=SCHEMAS["array"]))
    outs = llm.generate([[3, 4, 5]], params)[0].outputs
    for out in outs:
        assert out.finish_reason == "stop"
        check_output("array", out.text)
    assert len({o.text for o in outs}) > 1
    assert llm.engine.structured_output_manager.num_compiles == 1


# ---- the server ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served():
    from server_utils import Served, make_engine

    s = Served(make_engine())
    yield s
    s.stop()
    s.async_engine.shutdown(timeout=5)


def test_server_sdk_parse_returns_the_parsed_object(served):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog", "fish"]
        age: int = Field(ge=0, le=30)
        name: str = Field(max_length=6)

    client = served.client()
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for i in range(3):
        r = parse(model="tiny-llama", messages=[{"role": "user", "content": f"A pet, please ({i})"}],
                  response_format=Pet, temperature=0, max_tokens=200,
                  extra_body={"structured_outputs": {"disable_any_whitespace": True}})
        pet = r.choices[0].message.parsed
        assert isinstance(pet, Pet) and r.choices[0].finish_reason == "stop"
        assert Pet.model_validate_json(r.choices[0].message.content) == pet


def test_server_fields_and_streaming(served):
    import httpx

    def complete(**body):
        return httpx.post(served.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 60, "temperature": 0,
                                                                **body}, timeout=60)

    assert complete(guided_choice=CHOICE).json()["choices"][0]["text"] in CHOICE
    assert complete(structured_outputs={"choice": CHOICE}).json()["choices"][0]["text"] in CHOICE
    assert re.fullmatch(REGEX, complete(guided_regex=REGEX).json()["choices"][0]["text"])
    assert complete(guided_grammar='start: "ab" | "cd"').json()["choices"][0]["text"] in ("ab", "cd")
    tight = {"disable_any_whitespace": True}  # a random model may fill the whitespace it is allowed
    for body in ({"guided_json": SCHEMAS["enum"]}, {"guided_json": json.dumps(SCHEMAS["enum"])},
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMAS["enum"],
                                                                             "strict": True}}}):
        text = complete(**body, structured_outputs=tight).json()["choices"][0]["text"]
        jsonschema.validate(json.loads(text), SCHEMAS["enum"])
    for so in ({"json": SCHEMAS["enum"], **tight}, {"json": SCHEMAS["enum"], "disable_any_whitespace": False}):
        # with whitespace: at most 64 a gap
        text = complete(structured_outputs=so, max_tokens=240).json()["choices"][0]["text"]
        jsonschema.validate(json.loads(text), SCHEMAS["enum"])
    # Any object: a random model's keys need not end (the real model's do: the slow test below).
    choice = complete(response_format={"type": "json_object"}, max_tokens=200,
                      structured_outputs=tight).json()["choices"][0]
    assert choice["text"].startswith("{") and choice["finish_reason"] in ("stop", "length")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    assert complete(response_format={"type": "text"}, max_tokens=3).status_code == 200
    chunks = served.client().chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=100, stream=True,
        extra_body={"guided_json": SCHEMAS["numbers"], "structured_outputs": {"disable_any_whitespace": True}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS["numbers"])


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format", "response_format.json_schema.schema does not compile"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema is required"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "guided_json does not compile"),
    ({"guided_regex": "("}, "guided_regex", "guided_regex does not compile"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_grammar": "start: ("}, "guided_grammar", "guided_grammar does not compile"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs", "structured_outputs.json must be a JSON Schema"),
    ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs", "not supported"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "one kind"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "one kind"),
])
def test_server_400_names_the_field(served, body, param, words):
    import httpx

    from server_utils import error_of

    for route, base in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(served.url + route, json={**base, "max_tokens": 4, **body}, timeout=30)
        assert r.status_code == 400, r.text
        err = error_of(r)
        assert err["param"] == param and words in err["message"], err


def test_openapi_documents_the_fields(served):
    import httpx

    doc = httpx.get(served.url + "/openapi.json").json()
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = doc["components"]["schemas"][name]["properties"]
        assert {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar"} <= set(props)
    fmt = doc["components"]["schemas"]["JsonSchemaFormat"]["properties"]
    assert "schema" in fmt and "strict" in fmt


# ---- the real default model (slow) ----------------------------------------------------------------------

STR = {"type": "string", "maxLength": 40}  # a 135M model can repeat itself inside a string: give it an end
REAL_SCHEMAS = {
    "person": {"type": "object", "properties": {"name": STR, "age": {"type": "integer"},
                                                "city": STR},
               "required": ["name", "age", "city"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"capital": STR,
                                              "continent": {"enum": ["Europe", "Asia", "Africa", "America"]}},
             "required": ["capital", "continent"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"colours": {"type": "array", "items": STR,
                                                           "minItems": 3, "maxItems": 3}},
              "required": ["colours"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "book": {"type": "object", "properties": {"title": STR, "year": {"type": "integer"},
                                                  "author": {"type": "object", "properties": {"name": STR},
                                                             "required": ["name"], "additionalProperties": False}},
                 "required": ["title", "year", "author"], "additionalProperties": False}},
               "required": ["book"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"celsius": {"type": "integer"},
                                                 "fahrenheit": {"type": "number", "multipleOf": 0.5},
                                                 "boiling": {"type": "boolean"}},
                "required": ["celsius", "fahrenheit", "boiling"]},
}
REAL_QUESTIONS = {
    "person": "Describe a fictional person as JSON with name, age and city.",
    "enum": "What is the capital of France and on which continent is it? Answer in JSON.",
    "array": "Name three colours, as JSON.",
    "nested": "Give a famous book with its title, year and author as JSON.",
    "numbers": "Water boils at what temperature in Celsius and Fahrenheit? Answer in JSON.",
}


@pytest.mark.slow
def test_smollm_guided_outputs_validate_and_unguided_equal_mlx_lm(smollm):
    model, tok = smollm
    llm = LLM(model, tok, num_blocks=512)
    chat = lambda q: tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)  # noqa: E731
    prompts, params, names = [], [], []
    for name, schema in REAL_SCHEMAS.items():
        for ws in (False, True):
            prompts.append(chat(REAL_QUESTIONS[name]))
            params.append(SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(
                json=schema, disable_any_whitespace=ws)))
            names.append(name)
    prompts += [chat("What is the capital of France?"), chat("Is Paris in France? Answer yes or no."),
                chat("Give a date in ISO format."),
                chat("Where is Paris? Answer with a JSON object with the keys city and country.")]
    params += [SamplingParams(temperature=0, max_tokens=24),
               SamplingParams(temperature=0, max_tokens=10,
                              structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
               SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(
                   regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")),
               SamplingParams(temperature=0, max_tokens=120,
                              structured_outputs=StructuredOutputsParams(json_object=True))]
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    for name, out in zip(names, outs):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), REAL_SCHEMAS[name])
    plain, choice, date, obj = outs[len(names):]
    print("\n".join(f"{n}: {o.text!r}" for n, o in zip(names + ["plain", "choice", "date", "object"], outs)))
    want = solo_greedy(model, prompts[len(names)], 24, tuple(tok.eos_token_ids))
    assert plain.token_ids == want and "Paris" in plain.text
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.text)
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)
    assert_no_leaks(llm.engine)


@pytest.mark.slow
def test_smollm_server_sdk_parse(smollm):
    from pydantic import BaseModel
    from server_utils import Served

    class Capital(BaseModel):
        country: str
        capital: str

    model, tok = smollm
    served = Served(LLMEngine(model, tok, EngineConfig(num_blocks=256)))
    try:
        client = served.client()
        parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
        t = time.monotonic()
        r = parse(model="tiny-llama", response_format=Capital, temperature=0, max_tokens=60,
                  messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Capital) and "Paris" in parsed.capital, (r.choices[0].message.content,
                                                                           time.monotonic() - t)
    finally:
        served.stop()
        served.async_engine.shutdown(timeout=5)
