"""A start's phases (runner/start_times.py): laps that add up to the start, the start-up line naming the long ones."""

from __future__ import annotations

import time

from utils import make_model

from pagedmlx import LLM
from pagedmlx.engine.core_info import start_line
from pagedmlx.runner.start_times import MIN_SHOWN_S, StartTimes


def test_laps_add_up_and_the_line_names_only_the_long_phases():
    times = StartTimes()
    time.sleep(MIN_SHOWN_S + 0.05)
    times.lap("slow")
    times.lap("quick")
    time.sleep(MIN_SHOWN_S + 0.05)
    times.lap("slow")  # a phase met again adds up
    assert set(times.phases) == {"slow", "quick"} and times.phases["quick"] < MIN_SHOWN_S
    assert times.phases["slow"] >= 2 * MIN_SHOWN_S
    line = times.line()
    assert line.startswith(f"{sum(times.phases.values()):.1f} s: slow ") and "quick" not in line


def test_a_runners_start_is_timed_by_phase():
    llm = LLM(make_model("llama"), None)
    phases = llm.engine.runner.start_times.phases
    assert {"merge probe", "KV budget's profile step", "paged kernels' checks", "forward against mlx-lm",
            "pools"} <= set(phases)
    assert phases["forward against mlx-lm"] > 0 and start_line(llm.engine.core).startswith(
        f"{sum(phases.values()):.1f} s")
