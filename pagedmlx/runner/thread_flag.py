"""A flag per thread that a `with` block sets: the runner's forward turns its model-code swaps (merged
products, fused residuals) on for its own thread only, so mlx-lm's generation elsewhere runs unchanged."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class ThreadFlag(threading.local):
    on = False

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The flag set in this thread while inside (nested scopes restore what was there)."""
        before = self.on
        self.on = True
        try:
            yield
        finally:
            self.on = before
