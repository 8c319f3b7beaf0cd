"""`pagedmlx generate`'s closing lines, as mlx_lm.generate prints them: prompt and generation tokens
with their rates, and the peak memory."""

from __future__ import annotations

import time
from typing import Callable, Optional

from pagedmlx.outputs import EngineOutput


class GenerationStats:
    """Fed every output of a run (`add`); the prompt phase lasts until each request has its first token,
    generation from then to the last output, as mlx-lm times one prompt."""

    def __init__(self, num_requests: int, clock: Callable[[], float] = time.perf_counter):
        self.num_requests = num_requests
        self.clock = clock
        self.start = clock()
        self.prompt_tokens = self.generation_tokens = 0
        self.prompt_done: Optional[float] = None
        self.end = self.start
        self._started: set[str] = set()
        self._counted: set[str] = set()

    def add(self, out: EngineOutput) -> None:
        now = self.clock()
        self.generation_tokens += len(out.new_token_ids)
        if out.request_id not in self._counted:
            self._counted.add(out.request_id)
            self.prompt_tokens += len(out.prompt_token_ids)
        if out.new_token_ids and out.request_id not in self._started:
            self._started.add(out.request_id)
            if len(self._started) == self.num_requests:
                self.prompt_done = now
        self.end = now

    def lines(self, peak_memory_bytes: int) -> list[str]:
        prompt_done = self.end if self.prompt_done is None else self.prompt_done
        prompt_tps = self.prompt_tokens / max(prompt_done - self.start, 1e-9)
        # the first token of each request came with its prompt: the rest are generation's
        decoded = max(self.generation_tokens - len(self._started), 0)
        generation_tps = decoded / (self.end - prompt_done) if self.end > prompt_done else 0.0
        return ["=" * 10,
                f"Prompt: {self.prompt_tokens} tokens, {prompt_tps:.3f} tokens-per-sec",
                f"Generation: {self.generation_tokens} tokens, {generation_tps:.3f} tokens-per-sec",
                f"Peak memory: {peak_memory_bytes / 1e9:.3f} GB"]
