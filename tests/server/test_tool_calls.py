"""Tool calling: every parser on recorded-style outputs of its family, whole and streamed in
every split, and the server end to end with the openai SDK (a scripted "model" writes the calls)."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Optional

import httpx
import openai
import pytest
from parser_utils import ScriptedSampler, check_every_split, streamed, template_tokenizer, whole
from pydantic import BaseModel
from server_utils import MODEL, Served, engine_config, error_of
from tool_call_fixtures import BY_PARSER, NAMED, REQUIRED, REQUIRED_REPEATED, TOOLS, WEATHER
from utils import ARCHS, make_model, make_tokenizer

from pagedmlx.cli import main as cli_main
from pagedmlx.engine.detokenizer import IncrementalDetokenizer
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.server import chat_tools
from pagedmlx.server.chat_parsing import ChatOutputParser
from pagedmlx.server.chat_tools import ChatParsing, get_json_schema_from_tools
from pagedmlx.server.launch import chat_parsing
from pagedmlx.server.protocol import ChatCompletionRequest
from pagedmlx.server.tool_parsers import TOOL_PARSERS, detect_tool_parser
from pagedmlx.server.tool_parsers.forced_tool_parser import NamedToolParser, RequiredToolParser
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.server.tool_parsers.json_scan import JsonScanner


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS, **kw)


CASES = [(name, *fixture) for name, fixtures in BY_PARSER.items() for fixture in fixtures]


@pytest.mark.parametrize("parser,case,text,expected", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_parser_whole_and_every_split(parser, case, text, expected):
    req = request()
    check_every_split(lambda: ChatOutputParser(None, TOOL_PARSERS[parser](None, req)), text, expected)


@pytest.mark.parametrize("case,text,expected", REQUIRED, ids=[c[0] for c in REQUIRED])
def test_tool_choice_required_output(case, text, expected):
    req = request(tool_choice="required")
    check_every_split(lambda: ChatOutputParser(None, RequiredToolParser(None, req)), text, expected)


@pytest.mark.parametrize("case,text,expected", NAMED, ids=[c[0] for c in NAMED])
def test_tool_choice_named_output(case, text, expected):
    req = request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    check_every_split(lambda: ChatOutputParser(None, NamedToolParser(None, req)), text, expected)
    assert ChatOutputParser(None, NamedToolParser(None, req)).finish_reason("stop") == "stop"  # OpenAI's, named


def test_command_line_names_are_the_registered_parsers():
    from pagedmlx.server.parser_names import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES
    from pagedmlx.server.reasoning import REASONING_PARSERS

    assert TOOL_CALL_PARSER_NAMES == tuple(TOOL_PARSERS)
    assert REASONING_PARSER_NAMES == tuple(REASONING_PARSERS)


def test_vllm_entry_points_and_finish_reason():
    text = BY_PARSER["hermes"][2][1]
    info = TOOL_PARSERS["hermes"](None, request()).extract_tool_calls(text, request())
    assert info.tools_called and info.content == "I'll look that up for you."
    assert info.tool_calls[0].id.startswith("call_") and len(info.tool_calls[0].id) == 29
    parser = ChatOutputParser(None, TOOL_PARSERS["hermes"](None, request()))
    parser.whole(text)
    assert (parser.finish_reason("stop"), parser.finish_reason("length")) == ("tool_calls", "length")
    mistral = TOOL_PARSERS["mistral"](None, request()).extract_tool_calls(BY_PARSER["mistral"][0][1])
    assert len(mistral.tool_calls[0].id) == 9 and mistral.tool_calls[0].id.isalnum()  # Mistral's templates want it


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = BY_PARSER["hermes"][1][1]
    req = request(parallel_tool_calls=False)
    expected = (None, None, [("get_weather", '{"city": "San Francisco, CA, USA"}')])
    assert whole(lambda: ChatOutputParser(None, TOOL_PARSERS["hermes"](None, req)), text) == expected
    assert streamed(lambda: ChatOutputParser(None, TOOL_PARSERS["hermes"](None, req)), list(text)) == expected


@pytest.mark.parametrize("text", ['{"a":1,}', "[1 2]", '{"a" 1}', "[01]", '{"a": tru}', '{"a": "\\x"}', "[.5]", "{}}"])
def test_json_scanner_stops_at_the_first_bad_character(text):
    scanner = JsonScanner()
    with pytest.raises(ValueError):
        for ch in text:
            scanner.feed(ch)


def test_a_stop_tokens_text_is_left_out():
    """skip_special_tokens=False (mistral, harmony) kept the EOS's text in the output; as vLLM, a token
    that stopped the request is left out (unless include_stop_str_in_output)."""
    tok = make_tokenizer(ARCHS["llama"]["vocab_size"])
    ids = [*tok.encode("Done."), tok.eos_token_id]

    def text(finish_reason, **params):
        detok = IncrementalDetokenizer(tok, SamplingParams(skip_special_tokens=False, **params))
        return detok.update(ids, True, finish_reason == "stop")[0]
    assert text("stop") == "Done." and text("stop", include_stop_str_in_output=True) == "Done.<|im_end|>"
    assert text("length", ignore_eos=True) == "Done.<|im_end|>"  # not what stopped it


def test_parser_found_from_the_chat_template():
    def tok(template):
        return type("Tok", (), {"chat_template": template})()
    assert detect_tool_parser(tok("{{- '<tool_call>\\n' }}{{ tool_call | tojson }}")) == "hermes"
    assert detect_tool_parser(tok("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>")) == "qwen3_coder"
    assert detect_tool_parser(tok("{{ '[TOOL_CALLS]' }}")) == "mistral"
    assert detect_tool_parser(tok('{{- "<|python_tag|>" }}Environment: ipython')) == "llama3_json"
    assert detect_tool_parser(tok("<|channel|>commentary to=functions.x<|call|>")) == "openai"
    assert detect_tool_parser(tok("{% for m in messages %}{{ m.content }}{% endfor %}")) is None


def test_unknown_or_missing_parser_is_a_startup_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["serve", "--tool-call-parser", "nope"])
    assert exc.value.code == 2 and "hermes" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--reasoning-parser: unknown parser 'nope'; choose one of qwen3, deepseek_r1"):
        ChatParsing(reasoning_parser="nope")
    with pytest.raises(ValueError, match="needs --tool-call-parser.*choose one of hermes, qwen3_coder"):
        ChatParsing(enable_auto_tool_choice=True)
    qwen = type("Tok", (), {"chat_template": "{{ '<tool_call>' }}"})()
    plain = type("Tok", (), {"chat_template": "{{ m.content }}"})()

    def args(*argv):
        return argparse.Namespace(enable_auto_tool_choice="--enable-auto-tool-choice" in argv, reasoning_parser=None,
                                  tool_call_parser=argv[-1] if "--tool-call-parser" in argv else None)
    assert chat_parsing(args("--enable-auto-tool-choice"), qwen).tool_call_parser == "hermes"  # from the template
    assert chat_parsing(args("--tool-call-parser", "mistral"), qwen).auto_tools  # named: on, whatever the template
    assert not chat_parsing(args(), qwen).auto_tools  # off unless asked for
    with pytest.raises(ValueError, match="choose one of"):
        chat_parsing(args("--enable-auto-tool-choice"), plain)


def test_required_schema_is_vllms():
    schema = get_json_schema_from_tools("required", request().tools)
    assert schema["type"] == "array" and schema["minItems"] == 1
    first = schema["items"]["anyOf"][0]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert (first["properties"]["parameters"] == WEATHER["function"]["parameters"]
            and first["required"] == ["name", "parameters"])
    named = request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert get_json_schema_from_tools(named.tool_choice, named.tools) == WEATHER["function"]["parameters"]
    assert get_json_schema_from_tools("auto", request().tools) is None


# ---- the server ----------------------------------------------------------------------------------

# A Qwen2.5-style template that renders what tool calling sends it: tools, assistant tool_calls, tool results.
TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}{%- for m in messages %}{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response id={{ m.tool_call_id }}>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
REPLIES = {"#weather": "Let me check.\n" + CALL, "<tool_response": "It is 21 degrees in Paris.",
           "#required": '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', "#named": '{"city": "Rome"}'}


@pytest.fixture(scope="module")
def served():
    tokenizer = template_tokenizer(TEMPLATE)
    engine = LLMEngine(make_model("llama"), tokenizer, engine_config(max_model_len=2048, num_blocks=1024))
    engine.core.sampler = ScriptedSampler(engine.core.sampler, tokenizer, REPLIES)
    s = Served(engine, parsing=ChatParsing(tool_call_parser="hermes", enable_auto_tool_choice=True))
    yield s
    s.stop()


def test_openai_sdk_tools_example_round_trip(served):
    client = served.client()
    messages = [{"role": "user", "content": "#weather: what is the weather like in Paris today?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=200,
                                       extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    prompt = served.engine.tokenizer.decode(r.model_extra["prompt_token_ids"])
    assert '<tools>{"type": "function", "function": {"name": "get_weather", "description": "Get the current' in prompt
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=50,
                                        extra_body={"return_token_ids": True})
    assert r2.choices[0].message.content == "It is 21 degrees in Paris." and r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.tool_calls is None
    prompt = served.engine.tokenizer.decode(r2.model_extra["prompt_token_ids"])
    assert "<|im_start|>assistant\nLet me check." + CALL in prompt  # the arguments went in as an object
    assert f'<tool_response id={call.id}>\n{{"temperature": 21}}\n</tool_response>' in prompt


class GetWeather(BaseModel):
    city: str
    unit: str


def test_streamed_tool_calls_with_the_sdk_stream_helper(served):
    client = served.client()
    messages = [{"role": "user", "content": "#weather in Paris?"}]
    whole_r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=200)
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=[tool], max_tokens=200) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    assert message.tool_calls[0].function.parsed_arguments == GetWeather(city="Paris", unit="celsius")
    assert message.tool_calls[0].function.arguments == whole_r.choices[0].message.tool_calls[0].function.arguments


def test_raw_stream_chunks_have_openais_shape(served):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "#weather?"}], "tools": TOOLS, "stream": True,
            "max_tokens": 200}
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    first = next(d["tool_calls"][0] for d in deltas if d.get("tool_calls"))
    assert set(first) == {"index", "id", "type", "function"} and first["function"]["name"] == "get_weather"
    for d in deltas:
        assert "reasoning_content" not in d  # no reasoning parser: the field is left out
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_forced_tool_choice_with_guided_decoding(served, monkeypatch):
    """What guided decoding makes live: the grammar's constraint goes on the request, and its JSON output
    becomes the calls. The constraint is recorded on its way (into the real StructuredOutputsParams
    where this build has one, else into a stand-in)."""
    seen = []
    real = chat_tools.structured_outputs_class()

    def params_class(json):
        seen.append(json)
        return real(json=json) if real is not None else {"json": json}
    monkeypatch.setattr(chat_tools, "structured_outputs_class", lambda: params_class)
    client = served.client()
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "#required"}], tools=TOOLS,
                                       tool_choice="required", max_tokens=100)
    assert r.choices[0].finish_reason == "tool_calls" and seen[-1]["minItems"] == 1
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == \
        [("get_weather", '{"city": "Oslo"}')]
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "#named"}], tools=TOOLS,
                                            tool_choice=named, max_tokens=100, stream=True)
    chunks = list(stream)
    args = "".join(tc.function.arguments or "" for c in chunks for tc in c.choices[0].delta.tool_calls or [])
    assert args == '{"city": "Rome"}' and chunks[-1].choices[0].finish_reason == "stop"  # OpenAI's for named
    assert seen[-1] == WEATHER["function"]["parameters"]


@pytest.mark.parametrize("body,param,words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not in tools"),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tool_choice": "always"}, "tool_choice", "Input should be 'none', 'auto' or 'required', got 'always'"),
    ({"tool_choice": 3}, "tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function"'),
    ({"functions": [{"name": "f"}]}, "functions", "send tools"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs", "may not set tokenize"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "should match pattern"),
])
def test_what_cannot_be_honoured_is_a_400(served, body, param, words):
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 4, **body}
    response = httpx.post(served.url + "/v1/chat/completions", json=payload, timeout=30)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and words in error["message"], error


def test_forced_tool_choice_without_guided_decoding_is_a_400(served, monkeypatch):
    monkeypatch.setattr(chat_tools, "structured_outputs_class", lambda: None)  # a build without it
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": choice}
        error = error_of(httpx.post(served.url + "/v1/chat/completions", json=body, timeout=30))
        assert error["param"] == "tool_choice" and "guided decoding" in error["message"], error


def test_auto_needs_a_parser_on_the_server_and_unknown_fields_are_logged(caplog):
    s = Served(LLMEngine(make_model("llama"), make_tokenizer(ARCHS["llama"]["vocab_size"]), engine_config()))
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 2}
        error = error_of(httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30))
        assert error["param"] == "tools" and "--enable-auto-tool-choice" in error["message"]
        body.update(tool_choice="none", frobnicate=1)
        with caplog.at_level(logging.WARNING, logger="pagedmlx.server"):
            for _ in range(2):
                assert httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
        lines = [r.getMessage() for r in caplog.records if "frobnicate" in r.getMessage()]
        assert lines == ["ChatCompletionRequest: the field 'frobnicate' is not supported and was ignored"]
    finally:
        s.stop()


# ---- outputs cut by max_tokens, and repeated calls ---------------------------------------------------

def _cut(make, text: str) -> tuple[Optional[str], list[tuple[str, str]]]:
    message = make().whole(text, truncated=True)
    return message.content or None, [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_a_call_cut_by_max_tokens_is_no_call_and_no_content():
    """vLLM's: only what was parsed completely; the cut call's markup is not content either."""
    calls = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
             '<tool_call>\n{"name": "write_file", "arguments": {"path": "a"}}\n</tool_call>']
    text = "Let me check.\n" + calls[0] + "\n" + calls[1]
    ends = [text.index("}}", text.index(c[:30])) + 2 for c in calls]  # where each call's JSON closes
    want = [("get_weather", '{"city": "Paris"}'), ("write_file", '{"path": "a"}')]
    hermes = lambda: ChatOutputParser(None, TOOL_PARSERS["hermes"](None, request()))  # noqa: E731
    for i in range(len(text) + 1):
        content = (text[:i] if i <= len("Let me check.\n") else "Let me check.") or None  # no "\n" before a call
        assert _cut(hermes, text[:i]) == (content, [w for w, end in zip(want, ends) if i >= end]), text[:i]
    required = lambda: ChatOutputParser(None, RequiredToolParser(None, request(tool_choice="required")))  # noqa: E731
    array = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "write_file", "parameters": {}}]'
    ends = [array.index("}}") + 2, len(array) - 1]
    want = [("get_weather", '{"city": "Oslo"}'), ("write_file", "{}")]
    for i in range(len(array) + 1):
        assert _cut(required, array[:i]) == (None, [w for w, end in zip(want, ends) if i >= end]), array[:i]
    named = lambda: ChatOutputParser(None, NamedToolParser(None, request(  # noqa: E731
        tool_choice={"type": "function", "function": {"name": "get_weather"}})))
    assert _cut(named, '{"city": "Ro') == (None, [])


@pytest.mark.parametrize("case,text,expected", REQUIRED_REPEATED, ids=[c[0] for c in REQUIRED_REPEATED])
def test_tool_choice_required_drops_repeated_calls(case, text, expected):
    req = request(tool_choice="required")
    check_every_split(lambda: ChatOutputParser(None, RequiredToolParser(None, req)), text, expected)


def test_required_without_parallel_calls_is_one_call_by_grammar():
    schema = get_json_schema_from_tools("required", request().tools, parallel=False)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    assert "maxItems" not in get_json_schema_from_tools("required", request().tools)


def test_server_cut_tool_calls_finish_with_length(served):
    client = served.client()
    for max_tokens in (1, 3, 5, 8, 12):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "#required"}],
                                           tools=TOOLS, tool_choice="required", max_tokens=max_tokens)
        choice = r.choices[0]
        assert (choice.finish_reason, choice.message.tool_calls, choice.message.content) == ("length", None, ""), \
            (max_tokens, choice)
    for max_tokens in (6, 10, 14, 18):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "#weather"}],
                                           tools=TOOLS, max_tokens=max_tokens)
        choice = r.choices[0]
        assert choice.finish_reason == "length" and choice.message.tool_calls is None, (max_tokens, choice)
        assert "Let me check.".startswith(choice.message.content), (max_tokens, choice)
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "#weather"}],
                                                     tools=TOOLS, max_tokens=max_tokens, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
        assert chunks[-1].choices[0].finish_reason == "length"
