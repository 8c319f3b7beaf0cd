"""The engines (vLLM's vllm/v1/engine): EngineCore (core.py) and the process it runs in (core_proc.py, core_loop.py),
the front end's client for it (core_client.py), LLMEngine (offline, llm_engine.py), AsyncEngine (the server's,
async_engine.py), the output processor and detokenizer, and the engine's command-line options (arg_utils.py)."""
