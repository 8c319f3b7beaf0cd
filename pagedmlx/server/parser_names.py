"""The names --tool-call-parser and --reasoning-parser take, without importing the parsers (pydantic):
`pagedmlx serve` parses its command line before it starts the engine-core process. tool_parsers/ and
reasoning/ register the parsers under these names (tests/server/test_tool_calls.py checks)."""

TOOL_CALL_PARSER_NAMES = ("hermes", "qwen3_coder", "llama3_json", "mistral", "openai")
REASONING_PARSER_NAMES = ("qwen3", "deepseek_r1", "openai_gptoss")
