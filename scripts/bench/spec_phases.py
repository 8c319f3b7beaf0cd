"""Where a speculative round's host time goes, phase by phase: a context manager that times the engine
core's parts (exclusive time: a phase's own, less the phases inside it) while the engine runs.

Phases: schedule; verify build (the target step's graph: sampler, bookkeeping); verify forward (the target
runner's forward: its compiled replay or Python graph); draft forward (the draft runner's); propose (the
drafter's rules, the draft batches' metadata); process (verification, scheduler update, outputs);
wait (the round's one host sync); step dispatch (the verifying step's sampled arrays); "dispatch in"
each of them (mx.async_eval: MLX encoding the graph, or blocking while too much is queued) and "eval in"
(mx.eval: also waiting for the device); other (the rest of engine.step). With the wall clock
(perf_counter) on a GPU, a phase is time the host spends there; the device idles through whatever the
host does between the sync and the next round's first dispatch.

drained=True waits for the device (mx.synchronize, its own phase "drain before ...") before each forward's
dispatch: what MLX's encoding of a graph costs with nothing queued ahead of it. If "dispatch in verify forward"
then drops, the undrained figure was the host blocking on a full queue (a device-bound round), not encoding.

    with PhaseClock(engine) as clock:
        ... engine.step() ...
    clock.print(rounds)
"""

from __future__ import annotations

import collections
import time
from typing import Callable

import mlx.core as mx


class PhaseClock:
    def __init__(self, engine, timer: Callable[[], float] = time.perf_counter, drained: bool = False):
        self.drained = drained
        core = engine.__dict__.get("core", engine)  # an LLMEngine's EngineCore, or one
        self.timer = timer
        self.totals: collections.Counter = collections.Counter()
        self._stack: list[list] = []  # [tag, time inside nested phases]
        self._patches = [(mx, "async_eval", "dispatch"), (mx, "eval", "eval"),
                         (core.scheduler, "schedule", "schedule"), (core, "_build", "verify build"),
                         (core, "_wait", "wait"), (core, "_process", "process"), (core, "_propose", "propose"),
                         (core, "_dispatch", "step dispatch"),
                         (core, "step", "other"), (core.runner, "forward", "verify forward")]
        if getattr(core, "draft_proposer", None) is not None and hasattr(core.draft_proposer, "runner"):
            self._patches.append((core.draft_proposer.runner, "forward", "draft forward"))
        self._saved: list = []

    def _wrap(self, fn, tag: str):
        def timed(*args, **kwargs):
            name = f"{tag} in {self._stack[-1][0]}" if tag in ("dispatch", "eval") and self._stack else tag
            if self.drained and tag == "dispatch" and name.endswith(" forward"):
                t = self.timer()
                mx.synchronize()
                self.totals[f"drain before {name[len('dispatch in '):]}"] += self.timer() - t
                if self._stack:
                    self._stack[-1][1] += self.timer() - t
            self._stack.append([name, 0.0])
            t = self.timer()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = self.timer() - t
                _, inner = self._stack.pop()
                self.totals[name] += spent - inner
                if self._stack:
                    self._stack[-1][1] += spent
        return timed

    def __enter__(self) -> "PhaseClock":
        for obj, attr, tag in self._patches:
            fn = getattr(obj, attr)
            had = attr in vars(obj)  # a module's function or an instance's own; else the class's method
            self._saved.append((obj, attr, fn, had))
            setattr(obj, attr, self._wrap(fn, tag))
        return self

    def __exit__(self, *exc) -> None:
        for obj, attr, fn, had in reversed(self._saved):
            if had:
                setattr(obj, attr, fn)
            else:
                delattr(obj, attr)  # back to the class's method
        self._saved.clear()

    def rows(self, rounds: int) -> list[tuple[str, float]]:
        """(phase, ms per round), largest first, and the total."""
        rows = [(tag, 1e3 * t / rounds) for tag, t in self.totals.most_common()]
        return rows + [("total", sum(ms for _, ms in rows))]

    def print(self, rounds: int, title: str = "") -> None:
        print(f"\nhost time per round by phase{': ' + title if title else ''} ({rounds} rounds)")
        print("| phase | ms / round |")
        print("|---|---:|")
        for tag, ms in self.rows(rounds):
            print(f"| {tag} | {ms:.2f} |")
