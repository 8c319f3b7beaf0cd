"""`bench serve`'s progress over its requests: rich's bar on a terminal; where stderr is a pipe or a
file (which a live bar never reaches until it ends), a plain line every few seconds or tenth of the run."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import IO, Iterator, Optional, Protocol


class RequestProgress(Protocol):
    def update(self, completed: int) -> None: ...

    def advance(self) -> None: ...


class LineProgress:
    """`requests: done/total (pct) in N s` on `file`, at most every `interval` seconds or `step` requests,
    and once at the end."""

    def __init__(self, total: int, file: Optional[IO[str]] = None, interval: float = 5.0, step: Optional[int] = None):
        self.total, self.file, self.interval = total, file or sys.stderr, interval
        self.step = step or max(1, total // 10)
        self.completed = self._shown = 0
        self._start = self._last = time.monotonic()

    def update(self, completed: int) -> None:
        self.completed = completed
        now = time.monotonic()
        if completed >= self.total or completed - self._shown >= self.step or now - self._last >= self.interval:
            self._show(now)

    def advance(self) -> None:
        self.update(self.completed + 1)

    def close(self) -> None:
        if self._shown != self.completed or self.completed == 0:
            self._show(time.monotonic())

    def _show(self, now: float) -> None:
        pct = 100.0 * self.completed / self.total if self.total else 100.0
        print(f"requests: {self.completed}/{self.total} ({pct:.0f}%) in {now - self._start:.1f} s",
              file=self.file, flush=True)
        self._shown, self._last = self.completed, now


class _BarProgress:
    def __init__(self, bar, task):
        self.bar, self.task = bar, task

    def update(self, completed: int) -> None:
        self.bar.update(self.task, completed=completed)

    def advance(self) -> None:
        self.bar.advance(self.task)


class _NoProgress:
    def update(self, completed: int) -> None:
        pass

    def advance(self) -> None:
        pass


@contextlib.contextmanager
def request_progress(total: int, disable: bool = False) -> Iterator[RequestProgress]:
    """Progress over `total` requests on stderr: a rich bar on a terminal, else plain lines (LineProgress);
    nothing with `disable`."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    if disable:
        yield _NoProgress()
    elif console.is_terminal:
        with Progress(console=console, refresh_per_second=4) as bar:
            yield _BarProgress(bar, bar.add_task("requests", total=total))
    else:
        lines = LineProgress(total, file=console.file)
        try:
            yield lines
        finally:
            lines.close()
