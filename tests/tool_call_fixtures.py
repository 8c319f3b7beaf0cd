"""Model outputs of each tool call format, written as the models write them (from the formats' model
cards and chat templates, and vLLM's parser tests), with what each must parse to: (content,
reasoning, [(name, arguments)]). Arguments are exact strings: the JSON as the model wrote it (the
XML format's: json.dumps of the typed parameters)."""

from __future__ import annotations

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}, "hourly": {"type": "boolean"}, "threshold": {"type": "number"},
        "options": {"type": "object"}, "stations": {"type": "array", "items": {"type": "string"}}},
        "required": ["city"]}}}
WRITE_FILE = {"type": "function", "function": {
    "name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}}}}
TOOLS = [WEATHER, WRITE_FILE]

HERMES = [  # Qwen2.5 / Qwen3 (and Hermes 2 Pro)
    ("qwen25_one_call", '<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Boston, MA", "unit": "fahrenheit"}}'
     '\n</tool_call>', (None, None, [("get_weather", '{"city": "Boston, MA", "unit": "fahrenheit"}')])),
    ("qwen25_parallel", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco, CA, USA"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco, CA, USA", "days": 2}}'
     '\n</tool_call>', (None, None, [("get_weather", '{"city": "San Francisco, CA, USA"}'),
                                     ("get_weather", '{"city": "San Francisco, CA, USA", "days": 2}')])),
    ("text_then_call", "I'll look that up for you.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
     "{\"city\": \"K\u00f6ln\", \"unit\": \"celsius\"}}\n</tool_call>",
     ("I'll look that up for you.", None, [("get_weather", '{"city": "K\u00f6ln", "unit": "celsius"}')])),
    ("escapes_and_nesting", '<tool_call>\n{"name": "write_file", "arguments": {"path": "a/b.json", "content": '
     '"{\\"k\\": [1, {\\"x\\": \\"}\\"}]}\\n\\u00e9"}}\n</tool_call>',
     (None, None, [("write_file", '{"path": "a/b.json", "content": "{\\"k\\": [1, {\\"x\\": \\"}\\"}]}\\n\\u00e9"}')])),
    ("arguments_first", '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',
     (None, None, [("get_weather", '{"city": "Oslo"}')])),
    ("no_arguments", '<tool_call>\n{"name": "get_weather"}\n</tool_call>', (None, None, [("get_weather", "{}")])),
    ("raw_newline_in_string", '<tool_call>\n{"name": "write_file", "arguments": {"content": "line 1\nline 2"}}\n'
     '</tool_call>', (None, None, [("write_file", '{"content": "line 1\\nline 2"}')])),
    ("plain_answer", "The weather in Paris is sunny. Tags like <tool look odd but are text.\n",
     ("The weather in Paris is sunny. Tags like <tool look odd but are text.\n", None, [])),
    ("broken_before_the_name_is_content", 'Sure.\n<tool_call>\n{"name": get_weather}\n</tool_call>',
     ('Sure.\n<tool_call>\n{"name": get_weather}\n</tool_call>', None, [])),
    # once the name has been streamed the call stands; the text from the broken character on is content
    ("broken_after_the_name", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
     ("Sure.}}\n</tool_call>", None, [("get_weather", '{"city": ')])),
    ("cut_short", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     (None, None, [("get_weather", '{"city": "Par')])),
]

QWEN3_CODER = [  # Qwen3-Coder, Qwen3.5 / 3.6
    ("typed_parameters", "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
     "<parameter=days>\n5\n</parameter>\n<parameter=hourly>\nTrue\n</parameter>\n<parameter=threshold>\n0.5\n"
     "</parameter>\n<parameter=options>\n{\"radar\": true, \"layers\": [\"rain\"]}\n</parameter>\n"
     "<parameter=stations>\n['SFO', 'OAK']\n</parameter>\n</function>\n</tool_call>",
     (None, None, [("get_weather", '{"city": "San Francisco", "days": 5, "hourly": true, "threshold": 0.5, '
                    '"options": {"radar": true, "layers": ["rain"]}, "stations": ["SFO", "OAK"]}')])),
    ("code_file", "I'll create the file now.\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/hello.py\n"
     "</parameter>\n<parameter=content>\ndef hello():\n    print(\"Hello, <world>!\")\n\n\nhello()\n</parameter>\n"
     "</function>\n</tool_call>",
     ("I'll create the file now.", None, [("write_file", '{"path": "src/hello.py", "content": "def hello():\\n    '
                                           'print(\\"Hello, <world>!\\")\\n\\n\\nhello()"}')])),
    ("two_calls_no_parameters", "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n"
     "</function>\n</tool_call>\n<tool_call>\n<function=write_file>\n</function>\n</tool_call>",
     (None, None, [("get_weather", '{"city": "Lima"}'), ("write_file", "{}")])),
    ("missing_parameter_end", "<tool_call>\n<function=get_weather>\n<parameter=city>\nQuito\n<parameter=days>\n3\n"
     "</function>\n</tool_call>", (None, None, [("get_weather", '{"city": "Quito", "days": 3}')])),
    ("untyped_text_stays_text", "<tool_call>\n<function=get_weather>\n<parameter=unit>\n42\n</parameter>\n"
     "<parameter=unknown>\n[1, 2]\n</parameter>\n</function>\n</tool_call>",
     (None, None, [("get_weather", '{"unit": "42", "unknown": "[1, 2]"}')])),
]

LLAMA3_JSON = [  # Llama 3.1 / 3.2 / 3.3 with the JSON tool template
    ("llama31_one_call", '{"name": "get_weather", "parameters": {"city": "San Francisco, CA", "unit": "fahrenheit"}}',
     (None, None, [("get_weather", '{"city": "San Francisco, CA", "unit": "fahrenheit"}')])),
    ("python_tag", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     (None, None, [("get_weather", '{"city": "Paris"}')])),
    ("llama32_two_calls", '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_weather", "parameters": {"city": "London", "days": 1}}',
     (None, None, [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "London", "days": 1}')])),
    ("answer", "The current temperature in San Francisco is 65\u00b0F {clear sky}.",
     ("The current temperature in San Francisco is 65\u00b0F {clear sky}.", None, [])),
    ("json_that_is_no_call", '{"city": "Paris", "temperature": 21}',
     ('{"city": "Paris", "temperature": 21}', None, [])),
]

MISTRAL = [  # [TOOL_CALLS] is a special token, kept in the text
    ("v3_array", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris, France", "unit": "celsius"}}]',
     (None, None, [("get_weather", '{"city": "Paris, France", "unit": "celsius"}')])),
    ("v3_two_calls", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "write_file", '
     '"arguments": {"path": "w.txt", "content": "sunny"}}]',
     (None, None, [("get_weather", '{"city": "Paris"}'), ("write_file", '{"path": "w.txt", "content": "sunny"}')])),
    ("v11_args", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris, France", "unit": "celsius"}',
     (None, None, [("get_weather", '{"city": "Paris, France", "unit": "celsius"}')])),
    ("v11_text_then_two_calls", 'Let me check both cities.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
     ("Let me check both cities.", None, [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')])),
    ("v11_without_args_token", '[TOOL_CALLS]get_weather{"city": "Nice"}',
     (None, None, [("get_weather", '{"city": "Nice"}')])),
    ("call_id", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Bern"}',
     (None, None, [("get_weather", '{"city": "Bern"}')])),
    ("answer", "It is 18\u00b0C and cloudy in Paris [source: meteo].",
     ("It is 18\u00b0C and cloudy in Paris [source: meteo].", None, [])),
]

OPENAI = [  # gpt-oss, harmony (the detokenizer keeps the special tokens; <|call|> / <|return|> end generation)
    ("analysis_then_call", "<|channel|>analysis<|message|>User asks weather in Tokyo. Use get_weather.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city":"Tokyo"}<|call|>',
     (None, "User asks weather in Tokyo. Use get_weather.", [("get_weather", '{"city":"Tokyo"}')])),
    ("recipient_in_header", "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant "
     "to=functions.get_weather"
     '<|channel|>commentary json<|message|>{"city": "Kyoto"}',
     (None, "Need weather.", [("get_weather", '{"city": "Kyoto"}')])),
    ("final_answer", "<|channel|>analysis<|message|>2+2 is simple.<|end|><|start|>assistant<|channel|>final<|message|>"
     "2 + 2 = 4.<|return|>", ("2 + 2 = 4.", "2+2 is simple.", [])),
    ("preamble_then_call", "<|channel|>analysis<|message|>Check.<|end|><|start|>assistant<|channel|>commentary"
     "<|message|>"
     "Checking the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
     '<|message|>{"city":"Paris"}', ("Checking the weather.", "Check.", [("get_weather", '{"city":"Paris"}')])),
]

REQUIRED = [  # tool_choice "required": the output vLLM's grammar allows
    ("two_calls", '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "write_file", "parameters": '
     '{"path": "x", "content": "y"}}]', (None, None, [("get_weather", '{"city": "Paris"}'),
                                                      ("write_file", '{"path": "x", "content": "y"}')])),
    ("one_call_spaced", '[\n  {"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}\n]',
     (None, None, [("get_weather", '{"city": "Oslo", "days": 3}')])),
]

NAMED = [  # tool_choice {"type": "function", "function": {"name": "get_weather"}}: the arguments alone
    ("arguments", '{"city": "Paris", "unit": "celsius"}',
     (None, None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')])),
    ("spaced", '\n{ "city" : "Rome" }\n', (None, None, [("get_weather", '{ "city" : "Rome" }')])),
]

BY_PARSER = {"hermes": HERMES, "qwen3_coder": QWEN3_CODER, "llama3_json": LLAMA3_JSON, "mistral": MISTRAL,
             "openai": OPENAI}

# tool_choice "required" where the model repeats its call: each distinct call once
REQUIRED_REPEATED = [
    ("repeated_call", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_weather", "parameters": '
     '{"city": "Oslo"}}, {"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_weather", '
     '"parameters": {"city": "Oslo"}}]',
     (None, None, [("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')])),
]
