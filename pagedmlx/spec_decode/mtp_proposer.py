"""MTPProposer (vLLM's "mtp" method): the target checkpoint's own multi-token-prediction module
(spec_decode/mtp.py) proposes k tokens per speculating request and step, as a draft model does, on its own
pages in the target's block ids (draft_model.py, whose machinery this reuses with shift 1).

- Inputs: the MTP row at position i takes token i + 1 and the target's final hidden state at i; the
  target runner keeps every step's hidden states (ModelRunner.keep_hidden) and the engine hands them here
  after the step is read back (observe_step), for the requests that may speculate.
- Catch-up: each round, the rows from the first position whose MTP KV is not yet written with the target's
  hidden state up to the one before the request's last token (whose next token was just sampled): the
  positions the target computed since the last round (more while a prompt prefills in several steps).
  Its last row proposes the first draft; each later draft row takes the MTP's own output hidden state of
  the row before, so its KV is recomputed next round with the target's (never counted as written).
- Gaps: positions the target computed while the request did not speculate (a large batch, a pause, a
  prefix-cache hit) have no hidden state here; the catch-up starts after them and the MTP attends over
  what those pages hold. That costs acceptance only: the target verifies every draft.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from pagedmlx.config import EngineConfig
from pagedmlx.request import Request
from pagedmlx.runner.model import UnsupportedModelError, weights_nbytes
from pagedmlx.core.sched.output import SchedulerOutput
from pagedmlx.spec_decode.draft_model import DraftModelProposer, make_draft_proposer

logger = logging.getLogger("pagedmlx")


@dataclass
class _Chunk:
    first: int  # the position of the chunk's first row
    hidden: mx.array  # the step's (T, 1, H) hidden states
    row: int  # the chunk's first row in it
    count: int


class MTPProposer(DraftModelProposer):
    shift = 1

    def __init__(self, model, config: EngineConfig, num_speculative_tokens: int, verify: bool = True):
        # compiled decode steps would take the hidden states as constants of their trace
        super().__init__(model, config, num_speculative_tokens, verify, compile_decode=False)
        self.body = model.model
        self.runner.keep_hidden = True
        # What a draft token reads: the module's own weights and the LM head, not the embedding table (a gather)
        head = model.lm_head if isinstance(model.lm_head, nn.Module) else self.body.embed_tokens  # tied: the table
        self.weight_bytes = (weights_nbytes(model) - weights_nbytes(self.body.embed_tokens)
                             + (weights_nbytes(head) if head is self.body.embed_tokens else 0))
        self._chunks: "weakref.WeakKeyDictionary[Request, tuple[int, list[_Chunk]]]" = weakref.WeakKeyDictionary()
        self._next_hidden: Optional[mx.array] = None  # the last forward's sampled rows' hidden states

    def observe_step(self, so: SchedulerOutput, hidden: mx.array, requests: list[Request], drafter: Any) -> None:
        """Keep the target step's hidden states (T, 1, H) for its requests that may speculate (not while one
        is paused: each chunk holds its step's whole array)."""
        for i, req in enumerate(requests):
            if drafter.paused(req) or not drafter.speculates(req):
                continue
            preemptions, chunks = self._chunks.get(req, (req.num_preemptions, []))
            if preemptions != req.num_preemptions:
                chunks = []
            row = int(so.query_start_loc[i])
            chunks.append(_Chunk(int(so.positions[row]), hidden, row, int(so.num_scheduled_tokens[i])))
            self._chunks[req] = (req.num_preemptions, chunks)

    def _valid(self, req: Request) -> Optional[int]:
        """The catch-up's first position: after the MTP KV written with the target's hidden states, and after
        the last position without one (a gap); None where the last one (num_tokens - 2) has none."""
        start = super()._valid(req)
        end = req.num_tokens - 1
        covered = self._coverage(req, start, end)
        if not covered[-1]:
            return None
        gaps = np.flatnonzero(~covered)
        return start + int(gaps[-1]) + 1 if len(gaps) else start

    def _coverage(self, req: Request, start: int, end: int) -> np.ndarray:
        """(end - start,) bool: the positions start .. end - 1 that a kept chunk has a hidden state for."""
        covered = np.zeros(end - start, bool)
        for c in self._chunks.get(req, (0, []))[1]:
            lo, hi = max(c.first, start), min(c.first + c.count, end)
            if lo < hi:
                covered[lo - start:hi - start] = True
        return covered

    def _catch_up_inputs(self, reqs: list[Request], starts: list[int], counts: list[int]) -> None:
        """The catch-up rows' target hidden states, each position's from the latest chunk that has it; then
        the chunks no later round needs are dropped."""
        pieces = []
        for req, start, count in zip(reqs, starts, counts):
            chunks = self._chunks[req][1]
            owner = np.full(count, -1)
            for ci, c in enumerate(chunks):
                lo, hi = max(start, c.first), min(start + count, c.first + c.count)
                if lo < hi:
                    owner[lo - start:hi - start] = ci
            cuts = np.flatnonzero(np.diff(owner)) + 1
            for lo, hi in zip([0, *cuts], [*cuts, count]):
                c = chunks[owner[lo]]
                first_row = c.row + start + lo - c.first
                pieces.append(c.hidden[first_row:first_row + hi - lo])
            done = start + count  # positions below are written now (or, cut short by the budget, up to here)
            self._chunks[req] = (req.num_preemptions, [c for c in chunks if c.first + c.count > done])
        self.body.hidden = mx.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def _draft_inputs(self, src: np.ndarray) -> None:
        self.body.hidden = self._next_hidden[mx.array(src)]

    def _sample(self, so: SchedulerOutput, prev: Optional[mx.array], reqs: list[Request], offset: int) -> mx.array:
        try:
            tokens = super()._sample(so, prev, reqs, offset)
        finally:
            self.body.hidden = None
        self._next_hidden = self.runner.last_hidden[mx.array(so.logits_indices)]
        return tokens


def make_mtp_proposer(config: EngineConfig, target, verify: bool = True) -> MTPProposer:
    """The target's MTP module with its checkpoint's weights (speculative_config.model, else the target's own
    folder; random weights for a `random:` target) as a proposer. A ValueError names what is missing."""
    from pagedmlx.loaders.loader import RANDOM_PREFIX
    from pagedmlx.spec_decode.mtp import make_mtp_model

    spec = config.speculative_config
    source = spec.model
    if source is None and isinstance(config.model, str) and not config.model.startswith(RANDOM_PREFIX):
        source = config.model
    if source is None and not (isinstance(config.model, str) and config.model.startswith(RANDOM_PREFIX)):
        raise ValueError("speculative_config.method 'mtp' with a model object: give speculative_config.model, the "
                         "checkpoint folder holding its mtp.* weights")
    if target is None:
        raise ValueError("speculative_config.method 'mtp' needs the target model (its embedding, head and layer kind)")
    mtp = make_mtp_model(target, source, config.dtype)
    proposer = MTPProposer(mtp, config, spec.num_speculative_tokens, verify)
    if proposer.runner._head is None:
        raise UnsupportedModelError("speculative_config.method 'mtp': the MTP module's paged forward needs its body "
                                    "and head apart, and its load-time check refused the split")
    logger.info("speculative decoding: the model's MTP module (%s), %d draft tokens, while at most %d requests run",
                "random weights" if source is None
                else f"weights from {source if isinstance(source, str) else 'a dict'}",
                spec.num_speculative_tokens, spec.disable_by_batch_size)
    return proposer


def make_proposer(config: EngineConfig, verify: bool, target) -> tuple[Optional[DraftModelProposer], Any]:
    """The model-backed proposer speculative_config names (an MTP module or a draft model; None for n-gram),
    and a draft model's own tokenizer (None otherwise)."""
    spec = config.speculative_config
    if spec is not None and spec.method == "mtp":
        return make_mtp_proposer(config, target, verify), None
    return make_draft_proposer(config, verify)
