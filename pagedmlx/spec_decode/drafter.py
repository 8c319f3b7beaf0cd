"""Drafter: after each step, the draft tokens of the running requests that speculate (vLLM's
GPUModelRunner.propose_draft_token_ids over its drafter), and the adaptive rules of when not to.

- The batch: no request speculates while more than `disable_by_batch_size` run. Verifying k drafts
  costs k more query tokens of compute; at batch 1-4 a step is bound by reading the weights and they
  come almost free, at a large batch the step is compute-bound and a rejected draft is pure cost.
- A request: drafts accepted at less than `min_acceptance_rate` (a moving average of accepted /
  drafted, per draft) stop for PAUSE_TOKENS output tokens, twice as long each time it happens again
  (up to MAX_PAUSE_TOKENS); a request that starts quoting again later is drafted for again. A new
  request's estimate of a draft model's (or MTP module's) drafts starts from all requests' recent ones
  (the drafter's prior), not from certainty: below the rate it starts paused, so that a draft model that
  fails every request does not cost each new one the seven failed drafts its own estimate takes to fall.
  (The n-gram's acceptance is the text's, not the proposer's: each request starts from certainty.)
- How many (a draft model): each draft token costs a forward of the draft, about `cost_ratio` of a
  target step (their weights' bytes). Per request, k is the count of at most num_speculative_tokens
  that gives the most tokens per unit of cost, (1 - a^(k+1)) / (1 - a) / (1 + k * cost_ratio), where
  a is the request's estimated chance that a draft token is accepted (a moving estimate of accepted
  tokens over accepted tokens plus rejections). Near a = 1 that is all k; at a = 0.5 with a draft a
  quarter of the target, 1 or 2. The n-gram proposer costs nothing a token (cost_ratio 0): always k.
- Which source (draft_model / mtp with prompt_lookup): where the context's last tokens occurred earlier,
  the n-gram's draft costs no draft forward. A request takes it when it promises at least as many
  tokens a round per unit of cost as the model's best k, each at its own acceptance for the request
  (1 - a^(m+1)) / (1 - a) for an n-gram draft of m tokens; the model's draft otherwise. Each source
  keeps its own acceptance and pauses apart: a paused model still lets the n-gram draft, and the
  reverse. A lookup draft the model's beat is still scored against the tokens the step kept (no cost),
  so a request that starts quoting takes the lookup again.
- Not at all: guided requests (their grammar would have to accept each draft) and requests with
  penalties (each draft row's penalties would count the drafts before it); one log line per reason.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from pagedmlx.request import Request
from pagedmlx.spec_decode.config import SpeculativeConfig
from pagedmlx.spec_decode.ngram_proposer import NgramProposer
from pagedmlx.sample.rejection_sampler import num_accepted

logger = logging.getLogger("pagedmlx")

# each draft's weight in the moving average (from 1.0, seven drafts all rejected pause a request at 0.15)
RATE_WEIGHT = 0.25
PAUSE_TOKENS = 16
MAX_PAUSE_TOKENS = 1024


@dataclass
class _Acceptance:
    rate: float = 1.0  # moving average of accepted / drafted
    paused_until: int = 0  # the output length from which the request proposes again
    pause: int = PAUSE_TOKENS
    accepted: float = 0.0  # moving sums (weight RATE_WEIGHT) of accepted draft tokens and of rejections
    rejected: float = 0.0

    def count(self, accepted: int, rejected: bool) -> None:
        """One draft's accepted tokens, and whether one after them was rejected, into the moving sums."""
        keep = 1 - RATE_WEIGHT
        self.accepted = keep * self.accepted + accepted
        self.rejected = keep * self.rejected + rejected

    @property
    def token_rate(self) -> float:
        """The chance that one draft token is accepted, given the one before it was (1.0 before any draft)."""
        seen = self.accepted + self.rejected
        return self.accepted / seen if seen else 1.0


def round_gain(token_rate: float, k: int, cost_ratio: float) -> float:
    """Expected tokens a round of k drafts gives (the accepted ones and the target's own) per unit of the
    round's cost: a target step plus k draft tokens at cost_ratio each."""
    a = min(max(token_rate, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a) / (1 + k * cost_ratio)


def best_num_drafts(token_rate: float, cost_ratio: float, k_max: int) -> int:
    """The k <= k_max with the most expected tokens a round per unit of the round's cost (module docstring)."""
    return max(range(1, k_max + 1), key=lambda k: round_gain(token_rate, k, cost_ratio))


class Drafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Any = None, cost_ratio: float = 0.0):
        """proposer: the method's (a DraftModelProposer for draft_model); None: the n-gram proposer.
        cost_ratio: a draft token's cost in target steps (0: free, always num_speculative_tokens)."""
        self.config = config
        self.cost_ratio = cost_ratio
        self.max_model_len = max_model_len
        ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        self.proposer = proposer or ngram
        # A model's drafter that looks the context up too (the n-gram's draft where it pays more).
        self.lookup = ngram if proposer is not None and config.prompt_lookup else None
        self._acceptance: "weakref.WeakKeyDictionary[Request, _Acceptance]" = weakref.WeakKeyDictionary()
        self._lookup_acceptance: "weakref.WeakKeyDictionary[Request, _Acceptance]" = weakref.WeakKeyDictionary()
        self._from_lookup: "weakref.WeakSet[Request]" = weakref.WeakSet()  # whose pending draft is the n-gram's
        # The lookup's drafts not taken (from which position): scored against what the target then kept, so
        # that its estimate follows the text while the model drafts.
        self._unused: "weakref.WeakKeyDictionary[Request, tuple[int, list[int]]]" = weakref.WeakKeyDictionary()
        self.num_lookup_drafts = 0  # drafts taken from the lookup instead of the model
        self._logged: set[str] = set()
        self.num_paused = 0  # times a request stopped proposing for its low acceptance
        # A model's drafts of all requests: where a new request's estimate starts (None for the n-gram's).
        self.prior: Optional[_Acceptance] = _Acceptance() if proposer is not None else None

    def active(self, num_running: int) -> bool:
        """Whether requests speculate at this batch size."""
        return num_running <= self.config.disable_by_batch_size

    def skip_reason(self, request: Request) -> Optional[str]:
        if request.structured_output_request is not None:
            return "guided decoding (its grammar would have to accept each draft)"
        if request.sampling_params.has_penalties:
            return "penalties (each draft row's penalties would have to count the drafts before it)"
        return None

    def speculates(self, request: Request) -> bool:
        reason = self.skip_reason(request)
        if reason is not None and reason not in self._logged:
            self._logged.add(reason)
            logger.info("speculative decoding: requests with %s do not speculate (request %s)", reason,
                        request.request_id)
        return reason is None

    def paused(self, request: Request, table: Optional["weakref.WeakKeyDictionary"] = None) -> bool:
        """Whether the request's low acceptance keeps it from proposing now (from the proposer; table: the
        lookup's acceptance, for the lookup)."""
        state = (self._acceptance if table is None else table).get(request)
        return state is not None and request.num_output_tokens < state.paused_until

    def _model_acceptance(self, req: Request) -> _Acceptance:
        """The request's estimate of the model's drafts; a new one is the prior's, paused below the rate."""
        state = self._acceptance.get(req)
        if state is None:
            p = self.prior or _Acceptance()
            state = self._acceptance[req] = _Acceptance(rate=p.rate, accepted=p.accepted, rejected=p.rejected)
            if state.rate < self.config.min_acceptance_rate:
                self._pause(req, state)
        return state

    def _pause(self, request: Request, state: _Acceptance) -> None:
        floor = self.config.min_acceptance_rate
        state.paused_until = request.num_output_tokens + state.pause
        state.pause = min(2 * state.pause, MAX_PAUSE_TOKENS)
        state.rate = min(1.0, 2 * floor)  # after the pause, two or three bad drafts pause it again
        self.num_paused += 1

    def _lookup_draft(self, req: Request, room: int) -> list[int]:
        """The n-gram's draft where it pays at least as much as the model's (module docstring), else []."""
        if self.paused(req, self._lookup_acceptance):
            return []
        draft = self.lookup.propose(req, room)
        if not draft:
            return []
        if not self.paused(req):
            a, lookup = self._acceptance[req].token_rate, self._lookup_acceptance.get(req)
            k = best_num_drafts(a, self.cost_ratio, min(self.config.num_speculative_tokens, room))
            a_lookup = lookup.token_rate if lookup is not None else 1.0
            if round_gain(a_lookup, len(draft), 0.0) < round_gain(a, k, self.cost_ratio):
                self._unused[req] = (req.num_tokens, draft)
                return []
        return draft

    def propose_draft_token_ids(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        """Drafts for the requests that just sampled their last token (caught up: every token but it
        computed), where they speculate; at most what max_tokens and max_model_len leave after the
        token that the verification itself adds. A proposer with propose_batch drafts for all at once."""
        drafts, batch = {}, []
        for req in requests:
            if req.num_computed_tokens != req.num_tokens - 1 or req.num_output_placeholders or not self.speculates(req):
                continue
            room = self.max_model_len - req.num_tokens - 1
            max_tokens = req.sampling_params.max_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - req.num_output_tokens - 1)
            self._from_lookup.discard(req)
            self._unused.pop(req, None)
            state = self._model_acceptance(req)  # first: a new request may start paused
            if self.lookup is not None and room > 0 and (draft := self._lookup_draft(req, room)):
                drafts[req.request_id] = draft
                self._from_lookup.add(req)
                self.num_lookup_drafts += 1
                continue
            if self.paused(req):
                continue
            if self.cost_ratio:
                room = min(room, best_num_drafts(state.token_rate, self.cost_ratio, self.config.num_speculative_tokens))
            if room > 0 and hasattr(self.proposer, "propose_batch"):
                batch.append((req, room))
            elif room > 0:
                draft = self.proposer.propose(req, room)
                if draft:
                    drafts[req.request_id] = draft
        if batch:
            drafts.update(self.proposer.propose_batch(batch))
        return drafts

    def observe(self, request: Request, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """A verified draft of the request: update its acceptance rate, pause it when low."""
        if not num_draft_tokens:
            return
        lookup = request in self._from_lookup
        state = (self._lookup_acceptance.setdefault(request, _Acceptance()) if lookup
                 else self._model_acceptance(request))
        for est in (state,) if lookup or self.prior is None else (state, self.prior):
            est.rate += RATE_WEIGHT * (num_accepted_tokens / num_draft_tokens - est.rate)
            est.count(num_accepted_tokens, num_accepted_tokens < num_draft_tokens)
        unused = self._unused.pop(request, None)
        if unused is not None:  # the lookup's draft the model's beat: checked against the tokens kept
            start, draft = unused
            known = request.all_token_ids[start:start + len(draft)]
            a = num_accepted(known, draft)
            self._lookup_acceptance.setdefault(request, _Acceptance()).count(a, a < len(known))
        if state.rate < self.config.min_acceptance_rate:
            self._pause(request, state)
            if lookup:  # after the pause its next match is tried afresh
                state.accepted = state.rejected = 0.0


def make_drafter(config: Optional[SpeculativeConfig], max_model_len: int, kv_cache_manager, draft_proposer: Any = None,
                 vocab_size: int = 0, tokenizers: tuple = (None, None), target_bytes: int = 0) -> Optional[Drafter]:
    """The engine's Drafter; None where speculation is off (no config, or a recurrent-state target whose
    pool has no spare slots to roll back with). A draft model's proposer (spec_decode/draft_model.py) is
    bound to the target's pages here; tokenizers: the target's and the draft's, compared; target_bytes:
    the target's weights, against which a draft token's cost is counted."""
    if config is None:
        return None
    state = kv_cache_manager.state_manager
    if state is not None and not state.max_spares:
        logger.warning("speculative decoding is off: this model has recurrent-state layers and its state pool "
                       "has no spare slot per request to roll rejected drafts back with")
        return None
    if state is not None:
        logger.info("speculative decoding on recurrent-state layers: a verifying step writes each state to a "
                    "spare slot, and a rejection recomputes the accepted tokens from the state before it")
    if draft_proposer is not None:  # its own log line said what it is
        draft_proposer.bind(kv_cache_manager, vocab_size, *tokenizers)
    else:
        logger.info("speculative decoding: %s, %d draft tokens (n-grams of %d-%d tokens), while at most %d "
                    "requests run", config.method, config.num_speculative_tokens, config.prompt_lookup_min,
                    config.prompt_lookup_max, config.disable_by_batch_size)
    cost = draft_proposer.weight_bytes / target_bytes if draft_proposer is not None and target_bytes else 0.0
    if cost:
        logger.info("speculative decoding: a draft token costs about %.2f of a target step (the weights' bytes); "
                    "each request drafts the k up to %d that pays at its acceptance", cost,
                    config.num_speculative_tokens)
    if draft_proposer is not None and config.prompt_lookup:
        logger.info("speculative decoding: the context is looked up too (n-grams of %d-%d tokens); a request takes "
                    "the lookup's draft where it promises more tokens a step than the %s's", config.prompt_lookup_min,
                    config.prompt_lookup_max, "MTP module" if config.method == "mtp" else "draft model")
    return Drafter(config, max_model_len, draft_proposer, cost)
