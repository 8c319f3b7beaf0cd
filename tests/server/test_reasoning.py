"""Reasoning parsers: <think> models and gpt-oss's analysis channel, alone and composed with
the tool parsers (reasoning first, then tool calls in the content), whole and streamed in every split;
and the server: reasoning_content in responses and deltas, chat_template_kwargs to the template."""

from __future__ import annotations

import json

import pytest
from parser_utils import ScriptedSampler, check_every_split, template_tokenizer, whole
from server_utils import MODEL, Served, engine_config
from tool_call_fixtures import OPENAI, TOOLS
from utils import make_model

from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.server.chat_parsing import ChatOutputParser, chat_parser_factory
from pagedmlx.server.chat_tools import ChatParsing
from pagedmlx.server.protocol import ChatCompletionRequest
from pagedmlx.server.reasoning import REASONING_PARSERS
from pagedmlx.sampling_params import SamplingParams


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS, **kw)


REASONING = [  # (parser, case, text, (content, reasoning, calls), chat_template_kwargs)
    ("qwen3", "hybrid_thinking", "<think>\nThe user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391.\n</think>\n\n"
     "17 \u00d7 23 = **391**.",
     ("\n\n17 \u00d7 23 = **391**.", "\nThe user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51, "
      "so 391.\n", []), None),
    ("qwen3", "think_opened_in_the_prompt",
     "Okay, the user greets me. I should reply warmly.\n</think>\n\nHello! How can "
     "I help?", ("\n\nHello! How can I help?", "Okay, the user greets me. I should reply warmly.\n", []), None),
    ("qwen3", "cut_short_while_thinking", "<think>\nLet me consider </thi", (None, "\nLet me consider </thi", []),
     None),
    ("qwen3", "thinking_disabled", "Paris is the capital of France.", ("Paris is the capital of France.", None, []),
     {"enable_thinking": False}),
    ("deepseek_r1", "closed_in_the_prompt", "Hi! <think> is just text here.",
     ("Hi! <think> is just text here.", None, []), "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ("qwen3", "a_tag_mentioned_in_thinking", "I could write <tool_call> but not yet.\n</think>\n\nNo tool needed.",
     ("\n\nNo tool needed.", "I could write <tool_call> but not yet.\n", []), None),
    ("deepseek_r1", "r1_0528", "Okay, so I need to add 1 and 1.\n\nThat is 2.\n</think>\n\nThe answer is **2**.",
     ("\n\nThe answer is **2**.", "Okay, so I need to add 1 and 1.\n\nThat is 2.\n", []), None),
    ("deepseek_r1", "distill_with_think", "<think>\nHmm.\n</think>\n\n2", ("\n\n2", "\nHmm.\n", []), None),
    ("deepseek_r1", "no_end_all_reasoning", "Wait, let me recount", (None, "Wait, let me recount", []), None),
    *[("openai_gptoss", case, text, (expected[0] if not expected[2] else None, expected[1], []), None)
      for case, text, expected in OPENAI if case == "final_answer"],
]


@pytest.mark.parametrize("parser,case,text,expected,kwargs", REASONING, ids=[f"{r[0]}-{r[1]}" for r in REASONING])
def test_reasoning_whole_and_every_split(parser, case, text, expected, kwargs):
    """`kwargs`: the request's chat_template_kwargs, or (a string) the end of the prompt."""
    req = request(chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None)
    tail = kwargs if isinstance(kwargs, str) else ""
    check_every_split(lambda: ChatOutputParser(REASONING_PARSERS[parser](None, req, tail), None), text, expected)


COMPOSED = [  # (reasoning parser, tool parser, case, text, expected)
    ("qwen3", "hermes", "qwen3_think_then_call", "<think>\nThe user wants the weather in Paris; call get_weather.\n"
     "</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
     (None, "\nThe user wants the weather in Paris; call get_weather.\n", [("get_weather", '{"city": "Paris"}')])),
    ("qwen3", "qwen3_coder", "qwen35_call_inside_thinking", "The user wants Lima's weather.\n\n<tool_call>\n"
     "<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n"
     "</tool_call>", (None, "The user wants Lima's weather.\n\n", [("get_weather", '{"city": "Lima", "days": 2}')])),
    ("qwen3", "qwen3_coder", "qwen35_think_answer", "Simple.\n</think>\n\nIt is sunny.",
     ("\n\nIt is sunny.", "Simple.\n", [])),
    ("deepseek_r1", "hermes", "r1_then_call", "Need the tool.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", "
     "\"arguments\": {\"city\": \"Bonn\"}}\n</tool_call>",
     (None, "Need the tool.\n", [("get_weather", '{"city": "Bonn"}')])),
    *[("openai_gptoss", "openai", f"gptoss_{case}", text, expected) for case, text, expected in OPENAI],
]


@pytest.mark.parametrize("reasoning,tools,case,text,expected", COMPOSED, ids=[c[2] for c in COMPOSED])
def test_reasoning_then_tool_calls(reasoning, tools, case, text, expected):
    req = request()
    make = chat_parser_factory(req, ChatParsing(tools, True, reasoning), None, SamplingParams(), forced=False)
    check_every_split(make, text, expected)


def test_include_reasoning_false_and_special_tokens():
    req = request(include_reasoning=False)
    params = SamplingParams()
    make = chat_parser_factory(req, ChatParsing("hermes", True, "qwen3"), None, params, forced=False)
    assert whole(make, COMPOSED[0][3]) == (None, None, [("get_weather", '{"city": "Paris"}')])
    assert params.skip_special_tokens  # <think> and <tool_call> are not special tokens
    make = chat_parser_factory(request(), ChatParsing("openai", True, "openai_gptoss"), None, params, forced=False)
    assert not params.skip_special_tokens  # harmony's markers are: the detokenizer keeps them
    assert make().reasoning_parser is None  # the harmony tool parser reads the analysis channel itself
    plain = chat_parser_factory(request(tool_choice="none"), ChatParsing("hermes", True), None, SamplingParams(), False)
    assert plain is None  # no parser: the plain streaming path


# ---- the server ----------------------------------------------------------------------------------

TEMPLATE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
REPLIES = {"#think": "<think>\nThe user wants the weather in Lima.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
                     "<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>",
           "</think>\n\n": "Lima is sunny today."}


@pytest.fixture(scope="module")
def served():
    tokenizer = template_tokenizer(TEMPLATE)
    engine = LLMEngine(make_model("llama"), tokenizer, engine_config(max_model_len=2048, num_blocks=1024))
    engine.core.sampler = ScriptedSampler(engine.core.sampler, tokenizer, REPLIES)
    s = Served(engine, parsing=ChatParsing("qwen3_coder", True, "qwen3"))
    yield s
    s.stop()


def test_reasoning_and_tool_calls_whole_and_streamed(served):
    client = served.client()
    messages = [{"role": "user", "content": "#think: weather in Lima?"}]
    # (mlx-lm's wrapper passes enable_thinking=False itself where the vocabulary has no <think>, as this one)
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=300, extra_body=thinking)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == "\nThe user wants the weather in Lima.\n"
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"]
    assert message.content is None and r.choices[0].finish_reason == "tool_calls"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Lima"}
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=300, stream=True,
                                            extra_body=thinking)
    reasoning, args, finish = "", "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        args += "".join(c.function.arguments or "" for c in delta.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, args, finish) == (message.model_extra["reasoning_content"],
                                         message.tool_calls[0].function.arguments, "tool_calls")


def test_chat_template_kwargs_reach_the_template(served):
    client = served.client()
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=50,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                   "return_token_ids": True})
    message = r.choices[0].message
    assert message.content == "Lima is sunny today." and "reasoning_content" not in (message.model_extra or {})
    assert served.engine.tokenizer.decode(r.model_extra["prompt_token_ids"]).endswith("<think>\n\n</think>\n\n")
