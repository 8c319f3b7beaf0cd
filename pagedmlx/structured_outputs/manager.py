"""StructuredOutputManager (vLLM's name): the engine core's guided-decoding state.

- add_request: attach a StructuredOutputRequest and compile its grammar in a thread pool, cached by
  what it depends on (params.key()), so a new schema never stalls the step loop; the request waits
  (the scheduler skips it, vLLM's WAITING_FOR_FSM) until its grammar is ready.
- grammar_bitmask: each step, one int32 bitmask for the step's guided sampled rows, filled on the
  host from each request's matcher (llguidance's thread pool fills many at once); the sampler applies
  it on the device. Rows without a grammar are not in it and stay untouched.
- Matchers advance in the scheduler's update_from_output (StructuredOutputRequest.accept), once a
  step's tokens are on the host; a request's matcher always holds exactly its output tokens, and
  is re-synchronised (rolled back or caught up) where it does not.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from pagedmlx.structured_outputs.backend import GuidanceBackend, GuidanceGrammar
from pagedmlx.structured_outputs.params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedmlx.request import Request, RequestStatus

logger = logging.getLogger("pagedmlx")
CACHE_SIZE = 256  # compiled grammars kept (templates; each request copies its own)


@dataclass
class GrammarBitmask:
    """One step's mask: rows[i] is the sampled row (of the step's sampled requests) words[i] applies to."""

    rows: np.ndarray  # (G,) int32
    words: np.ndarray  # (G, ceil(vocab / 32)) int32: bit t of word t // 32 set = token t allowed


class StructuredOutputRequest:
    """A guided request's grammar: compiling (a future), then its own matcher."""

    def __init__(self, params: StructuredOutputsParams, future: cf.Future):
        self.params = params
        self._future = future
        self._grammar: Optional[GuidanceGrammar] = None

    def is_ready(self) -> bool:
        """Compiled. One whose compilation failed never is: the engine finishes it (take_failed)."""
        return self._grammar is not None or (self._future.done() and self._future.exception() is None)

    @property
    def compile_error(self) -> Optional[BaseException]:
        return self._future.exception() if self._grammar is None and self._future.done() else None

    @property
    def grammar(self) -> GuidanceGrammar:
        if self._grammar is None:
            self._grammar = GuidanceGrammar(self._future.result().deep_copy())
        return self._grammar

    def accept(self, token: int) -> None:
        """The request's new output token (Scheduler.update_from_output)."""
        self.grammar.accept_token(token)

    def finish_status(self) -> Optional["RequestStatus"]:
        """FINISHED_STOPPED once the grammar has ended, FINISHED_ERROR if a token broke it, else None."""
        from pagedmlx.request import RequestStatus

        grammar = self.grammar
        if not grammar.is_terminated:
            return None
        if grammar.error is not None:
            logger.warning("guided request: its grammar rejected a sampled token: %s", grammar.error)
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Make the matcher hold exactly these tokens (it has consumed a prefix of them, or more)."""
        grammar = self.grammar
        n = len(output_token_ids)
        if grammar.num_processed_tokens > n:
            grammar.rollback(grammar.num_processed_tokens - n)
        for token in output_token_ids[grammar.num_processed_tokens:]:
            grammar.accept_token(token)


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], max_workers: int = 1):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_workers = max_workers
        self._backend: Optional[GuidanceBackend] = None
        self._executor: Optional[cf.ThreadPoolExecutor] = None
        self._cache: OrderedDict[tuple, cf.Future] = OrderedDict()
        self._pending: dict[str, "Request"] = {}  # guided requests whose grammar is still compiling
        self._fill_executor = None  # llguidance's own thread pool for batched mask fills
        self.num_compiles = 0  # grammars compiled (the rest came from the cache)
        self.num_requests = 0  # guided requests added

    @property
    def backend(self) -> GuidanceBackend:
        if self._backend is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer; this engine has none")
            self._backend = GuidanceBackend(self.tokenizer, self.eos_token_ids)
            self._executor = cf.ThreadPoolExecutor(self.max_workers, thread_name_prefix="pagedmlx-grammar")
        return self._backend

    # ---- requests --------------------------------------------------------------------------

    def add_request(self, request: "Request") -> None:
        """Attach the request's grammar (compiling, or from the cache); no-op for unguided requests."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        self.num_requests += 1
        backend = self.backend
        key = params.key()
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._executor.submit(backend.compile, params)
            self.num_compiles += 1
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        request.structured_output_request = StructuredOutputRequest(params, future)
        if not request.structured_output_request.is_ready():  # compiling, or failed already
            self._pending[request.request_id] = request

    def take_failed(self) -> list[tuple["Request", str]]:
        """Guided requests whose grammar failed to compile, with the error (each returned once)."""
        failed = []
        for rid, req in list(self._pending.items()):
            so = req.structured_output_request
            if req.is_finished or so is None:
                del self._pending[rid]
            elif so.compile_error is not None:
                del self._pending[rid]
                failed.append((req, f"{type(so.compile_error).__name__}: {so.compile_error}"))
            elif so.is_ready():
                del self._pending[rid]
        return failed

    def wait_for_grammars(self, timeout: float) -> None:
        """Nothing could be scheduled: let a compiling grammar finish (up to `timeout` s) instead of spinning."""
        futures = [r.structured_output_request._future for r in self._pending.values()
                   if r.structured_output_request is not None]
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    # ---- each step ---------------------------------------------------------------------------

    def grammar_bitmask(self, requests: Sequence["Request"]) -> Optional[GrammarBitmask]:
        """The step's bitmask for its sampled `requests` (in row order), or None if none is guided."""
        rows = [i for i, r in enumerate(requests) if r.structured_output_request is not None]
        if not rows:
            return None
        words = np.zeros((len(rows), (self.backend.vocab_size + 31) // 32), dtype=np.int32)
        grammars = []
        for i in rows:
            req = requests[i]
            if req.num_output_placeholders:
                raise RuntimeError(f"guided request {req.request_id} has a token in flight: its mask would miss it "
                                   f"(the engine must not overlap steps with guided rows)")
            so = req.structured_output_request
            so.sync(req.output_token_ids)
            grammars.append(so.grammar)
        if len(grammars) > 1:  # llguidance fills them in its own threads
            import llguidance
            import llguidance.numpy

            if self._fill_executor is None:
                self._fill_executor = llguidance.LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(
                self._fill_executor, [(g.matcher, j) for j, g in enumerate(grammars)], words)
        else:
            grammars[0].fill_bitmask(words[0])
        return GrammarBitmask(np.asarray(rows, np.int32), words)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
