"""`pagedmlx serve` under test in a subprocess (server_utils.ServeProcess): the tiny random model
instead of a real one, and steps slowed down enough to catch requests in flight. The engine-core
process is spawned (a fresh interpreter), so it installs the same hooks itself before it starts."""

from __future__ import annotations

import functools
import sys
import time
import types


def install(step_sleep: float) -> None:
    def load_model(name, lazy=False, dtype=None):
        from utils import make_model, make_tokenizer

        return make_model("llama"), make_tokenizer(512)

    loader = types.ModuleType("pagedmlx.loaders.loader")
    loader.load_model = load_model
    loader.generation_defaults = lambda name: {}
    loader.weights_path = lambda name: None  # no files behind it: its check is never kept
    sys.modules["pagedmlx.loaders.loader"] = loader  # no real model: the CLI and the core load through this
    from pagedmlx.engine import core_proc as proc
    from pagedmlx.engine.core import EngineCore

    step = EngineCore.step
    EngineCore.step = lambda self: (time.sleep(step_sleep), step(self))[1]
    if not hasattr(proc, "real_run_engine_core"):
        proc.real_run_engine_core = proc.run_engine_core
        proc.run_engine_core = functools.partial(run_engine_core, step_sleep)  # what CoreProcess spawns


def run_engine_core(step_sleep: float, args) -> None:
    """The engine-core process's main, with the hooks installed there too."""
    install(step_sleep)
    from pagedmlx.engine import core_proc as proc

    proc.real_run_engine_core(args)
