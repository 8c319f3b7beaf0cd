"""The `pagedmlx` command (vLLM's entrypoints/cli): main.py declares the subcommands and runs them; doctor.py is
`pagedmlx doctor`, generate_stats.py the closing lines of `pagedmlx generate`. `python -m pagedmlx.cli` is the
same command."""

from pagedmlx.cli.main import build_engine, engine_config, load_engine, main, make_parser, model_arg

__all__ = ["build_engine", "engine_config", "load_engine", "main", "make_parser", "model_arg"]
