"""A step's records: the step in flight (LaunchedStep) and where steps' time goes (StepStats)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pagedmlx.request import Request
from pagedmlx.core.sched.output import SchedulerOutput


@dataclass
class LaunchedStep:
    """A step whose graph is built (and maybe running on the device) but not read back yet."""

    so: SchedulerOutput
    requests: list[Request]  # the scheduled requests themselves: an id may be reused once one ends
    sampled: Any  # SamplerOutput, or None for a step of partial prefill chunks only
    arrays: list  # what the device must compute
    build_s: float
    error: Optional[Exception] = None
    prompt: Any = None  # SamplerOutput of the prompt rows that score prompt tokens (prompt_logprobs)
    prompt_rows: Optional[list] = None  # ... read back
    hidden: Any = None  # the target's final hidden states (T, 1, H), kept for an MTP module


@dataclass
class StepStats:
    """Where a step's time goes: host work around the forward pass versus the pass itself."""

    num_steps: int = 0
    schedule_s: float = 0.0
    build_s: float = 0.0  # building the step's graph and dispatching it
    wait_s: float = 0.0  # waiting for the device (the one host sync)
    update_s: float = 0.0  # appending tokens, stop checks
    num_tokens: int = 0
    num_sampled: int = 0
    num_overlapped: int = 0  # steps built while the previous one ran on the device

    @property
    def forward_s(self) -> float:
        return self.build_s + self.wait_s

    def record(self, so: SchedulerOutput, update_s: float) -> None:
        """Count a step that completed."""
        self.num_steps += 1
        self.update_s += update_s
        self.num_tokens += so.total_num_scheduled_tokens
        self.num_sampled += len(so.sampled_req_ids)

    def host_fraction(self) -> float:
        total = self.schedule_s + self.forward_s + self.update_s
        return (self.schedule_s + self.update_s) / total if total else 0.0
