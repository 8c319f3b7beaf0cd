"""Where a start's seconds go: the runner's phases (the merge probe, the KV budget's profile step, each load-time
check), timed as laps and shown in the start-up lines. A cold start (an empty kernel cache) spends minutes
compiling kernels; this line says in which phase."""

from __future__ import annotations

import time

MIN_SHOWN_S = 0.1  # shorter phases are left out of the line


class StartTimes:
    """Laps of a start: lap(name) closes the phase that began at the previous lap (or at creation)."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now

    def line(self) -> str:
        """"12.3 s: kernel checks 8.1 s, forward against mlx-lm 3.9 s" (phases of MIN_SHOWN_S or more)."""
        shown = [f"{name} {s:.1f} s" for name, s in self.phases.items() if s >= MIN_SHOWN_S]
        return f"{sum(self.phases.values()):.1f} s" + (": " + ", ".join(shown) if shown else "")
