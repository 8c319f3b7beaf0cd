"""DraftModelProposer (vLLM's "draft_model" method): a smaller mlx-lm model with the target's tokenizer
proposes k tokens per speculating request and step; the target verifies them in its next step.

- Pages: the draft has its own per-layer page pools, with one page per block of the target's
  full-attention KV cache group, addressed by the target's block ids. Allocation, prefix sharing,
  preemption and freeing stay the target's one accounting (and the KV budget counts both models'
  bytes per block: ModelRunner's draft_block_bytes).
- Validity: per request, the draft's KV is known good for its first `valid` tokens: those it caught
  up on, and the drafts it wrote that the target then accepted. Rejected positions are simply
  recomputed (rollback by count, as the target's). A preempted request starts over from position 0:
  a prefix hit shares the target's pages, not the proof that the draft's pages in them were written.
- A step: one forward over every request's catch-up (its uncomputed tokens up to its last one: a
  decode, or a prefill segment; at most max_num_batched_tokens of them a step, so that a long prompt's
  catch-up takes several steps, drafting nothing until it ends, and never stalls the batch), which
  proposes each request's first draft; then k - 1 one-token
  forwards, each batched over the requests still drafting, token-major as the runner's forward. Each
  proposed token feeds the next forward on the device (the runner's placeholder rows).
- Tokens: sampler.sample_draft_tokens (greedy: argmax; sampled: the target row's own Gumbel noise).
  They stay on the device (DeviceDrafts): the target's verifying step takes them as placeholder inputs
  and is dispatched behind the draft's forwards, so a round (k draft forwards, one verifying step)
  has one host sync, the verifying step's; the engine reads the drafts back with its tokens.
- Refused: draft models with sliding-window or recurrent-state layers (their pages would need their
  own windows and state slots), and targets without a full-attention group.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from pagedmlx.config import EngineConfig
from pagedmlx.core.kv.spec import FullAttentionSpec
from pagedmlx.request import Request
from pagedmlx.runner.model import ModelRunner, UnsupportedModelError, model_type, weights_nbytes
from pagedmlx.sample.sampler import sample_draft_tokens
from pagedmlx.core.sched.output import SchedulerOutput, _block_table

logger = logging.getLogger("pagedmlx")


@dataclass
class _DraftState:
    base: int  # the request's num_tokens when it last proposed: the draft's KV before it is valid
    written: Sequence[int]  # the drafts whose KV was written at positions base, base + 1, ...
    num_preemptions: int


class DeviceDrafts(list):
    """One request's drafts while they are still on the device: k zeros standing in for them (a list,
    so that the scheduler counts and slices them as host drafts), and `src`, where each one is in
    `tokens`, the flat (N,) int32 array of one propose_batch. `values()` reads them back once the
    array is computed (after the step that verifies them has been read back: no wait then)."""

    def __init__(self, tokens: mx.array, src: Sequence[int]):
        super().__init__([0] * len(src))
        self.tokens, self.src = tokens, list(src)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return DeviceDrafts(self.tokens, self.src[index])
        return super().__getitem__(index)

    def values(self) -> list[int]:
        return np.asarray(self.tokens)[self.src].tolist() if self.src else []


def make_draft_proposer(config: EngineConfig, verify: bool = True) -> tuple[Optional["DraftModelProposer"], Any]:
    """The proposer of speculative_config's draft model (None unless method is draft_model), and the
    draft's tokenizer (None for a model object), loaded in config.dtype as the target."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None, None
    model, tokenizer = spec.model, None
    if not isinstance(model, nn.Module):
        from pagedmlx.loaders.loader import load_model

        model, tokenizer = load_model(str(model), dtype=config.dtype)
    if config.dtype is not None:  # quantized weights keep their packed form
        model.set_dtype(getattr(mx, config.dtype))
    proposer = DraftModelProposer(model, config, spec.num_speculative_tokens, verify)
    logger.info("speculative decoding: a draft model (%s, %d layers), %d draft tokens, while at most %d requests "
                "run", model_type(model), len(proposer.runner.plan), spec.num_speculative_tokens,
                spec.disable_by_batch_size)
    return proposer, tokenizer


class DraftModelProposer:
    # The draft's row at position i takes token i + shift (an MTP module's, 1: token i + 1 with the target's
    # hidden state at i; mtp_proposer.py), and its logits propose token i + 1 + shift.
    shift = 0

    def __init__(self, model: nn.Module, config: EngineConfig, num_speculative_tokens: int, verify: bool = True,
                 **runner_config):
        self.k = num_speculative_tokens
        # Built on 2 blocks; bind() gives it one page per block of the target's pool.
        draft_config = dataclasses.replace(config, model=None, num_blocks=2, speculative_config=None,
                                           enable_lora=False, max_model_len=None, **runner_config)
        self.runner = ModelRunner(model, draft_config, verify=verify)
        odd = sorted({p.kind for p in self.runner.plan} - {"full", "shared"})
        if odd:
            raise UnsupportedModelError(
                f"draft model type {model_type(model)!r} has {' and '.join(odd)} layers: a draft model must have "
                "full-attention layers only (its pages follow the target's full-attention block ids)")
        self.weight_bytes = weights_nbytes(model)  # a draft token's cost against the target's (Drafter)
        self.block_size = config.block_size
        self.max_catch_up = config.max_num_batched_tokens  # tokens a step's first draft forward may take
        self.manager = None  # the target's full-attention group manager (bind)
        self.vocab_size = self.runner.vocab_size
        self._state: "weakref.WeakKeyDictionary[Request, _DraftState]" = weakref.WeakKeyDictionary()

    @property
    def bytes_per_block(self) -> int:
        return self.runner.bytes_per_block

    def bind(self, kv_cache_manager, vocab_size: int, target_tokenizer: Any = None,
             draft_tokenizer: Any = None) -> None:
        """Check the pair and give the draft one page per block of the target's full-attention group."""
        if self.runner.vocab_size < vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.runner.vocab_size} tokens) is smaller than the "
                             f"target's ({vocab_size}): draft and target must share a tokenizer")
        if target_tokenizer is not None and draft_tokenizer is not None:
            vt, vd = _vocab(target_tokenizer), _vocab(draft_tokenizer)
            if vt is not None and vd is not None and vt != vd:
                diff = len(set(vt.items()) ^ set(vd.items()))
                raise ValueError(f"the draft model's tokenizer differs from the target's ({len(vd)} vs {len(vt)} "
                                 f"tokens, {diff} entries differ): draft and target must share a tokenizer")
        groups = kv_cache_manager.kv_cache_config.kv_cache_groups
        full = [g for g, group in enumerate(groups) if isinstance(group.kv_cache_spec, FullAttentionSpec)]
        if not full:
            raise UnsupportedModelError("a draft model needs a target with full-attention layers (its pages follow "
                                        "their block ids); this target has none")
        self.manager = kv_cache_manager.managers[full[0]]
        config = self.runner.kv_cache_config
        config.kv_cache_groups[0].num_blocks = groups[full[0]].num_blocks
        self.runner.kv_pool = None  # drop the 2-block pool first
        self.runner.kv_pool = self.runner.make_pool(config)
        self.vocab_size = vocab_size

    def forget(self) -> None:
        """Every request's draft KV is gone (the runner zeroed the pages): each catches up from position 0."""
        self._state.clear()

    def _valid(self, req: Request) -> int:
        """Tokens from position 0 whose draft KV is in the request's pages (at most all but its last)."""
        st = self._state.get(req)
        if st is None or st.num_preemptions != req.num_preemptions:
            return 0
        tokens = req.all_token_ids
        n = st.base
        written = st.written.values() if isinstance(st.written, DeviceDrafts) else st.written
        for d in written:
            if n >= len(tokens) or tokens[n] != d:
                break
            n += 1
        return min(n, req.num_tokens - 1 - self.shift)

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        """Pages for the request's first num_tokens tokens in the target's full group (the draft writes
        its drafts' KV before the target's next step allocates their slots): all or nothing."""
        m, rid = self.manager, req.request_id
        if rid not in m.req_to_blocks:
            return False
        need = m.get_num_blocks_to_allocate(rid, num_tokens, [])
        if need > m.block_pool.get_num_free_blocks():
            return False
        if need:
            m.allocate(rid, num_tokens, [])
        return True

    def propose_batch(self, items: Sequence[tuple[Request, int]]) -> dict[str, list[int]]:
        """Drafts of at most min(k, room) tokens for each (request, room), as DeviceDrafts: dispatched,
        not waited for."""
        work = []
        for req, room in items:
            k = min(self.k, room)
            if k > 0 and self._reserve(req, req.num_tokens + k - 1) and (start := self._valid(req)) is not None:
                work.append((req, start, k))
        work = self._within_budget(work)
        if not work:
            return {}
        reqs = [w[0] for w in work]
        starts = [w[1] for w in work]
        counts = [w[3] for w in work]
        d = self.shift
        ids = np.fromiter((t for r, s, c in zip(reqs, starts, counts) for t in r.all_token_ids[s + d:s + c + d]),
                          np.int32, sum(counts))
        self._catch_up_inputs(reqs, starts, counts)
        steps = [self._sample(self._batch(reqs, starts, counts, ids), None, reqs, 0)]
        alive = list(range(len(work)))  # indices into work still drafting
        for j in range(1, max(w[2] for w in work)):
            prev = alive
            alive = [i for i in alive if work[i][2] > j]
            src = np.asarray([prev.index(i) for i in alive], np.int32)
            sub = [reqs[i] for i in alive]
            so = self._batch(sub, [r.num_tokens + j - 1 - d for r in sub], [1] * len(sub), np.zeros(len(sub), np.int32),
                             placeholder_src=src)
            self._draft_inputs(src)
            steps.append(self._sample(so, steps[-1], sub, j))
        flat = mx.concatenate(steps) if len(steps) > 1 else steps[0]
        (mx.async_eval if self.runner.pages_in_place else mx.eval)(flat)
        src: dict[int, list[int]] = {i: [] for i in range(len(work))}  # each request's drafts' places in flat
        rows, at = list(range(len(work))), 0  # the requests in forward j: all, then those drafting past j
        for j in range(len(steps)):
            if j:
                rows = [i for i in rows if work[i][2] > j]
            for pos, i in enumerate(rows):
                src[i].append(at + pos)
            at += len(rows)
        drafts: dict[str, list[int]] = {}
        for i, (req, start, k, count) in enumerate(work):
            if k == 0:  # a catch-up cut short: its KV is good up to where it stopped, no drafts yet
                self._state[req] = _DraftState(start + count, [], req.num_preemptions)
            else:
                drafts[req.request_id] = DeviceDrafts(flat, src[i])
                # the drafts' own KV counts as written where they are accepted; not an MTP module's (its rows
                # took its own hidden states, not the target's: recomputed next round)
                written = [] if d else drafts[req.request_id][:-1]
                self._state[req] = _DraftState(req.num_tokens - d, written, req.num_preemptions)
        return drafts

    def _catch_up_inputs(self, reqs: list[Request], starts: list[int], counts: list[int]) -> None:
        """Hook before the first forward (rows: each request's counts[i] positions from starts[i])."""

    def _draft_inputs(self, src: np.ndarray) -> None:
        """Hook before each later forward (its rows: the previous forward's sampled rows `src`)."""

    def _within_budget(self, work: list[tuple[Request, int, int]]) -> list[tuple[Request, int, int, int]]:
        """(request, start, k, count) for the step's first forward: decodes first (as the runner wants),
        then catch-ups, shortest first, while max_catch_up tokens last; the catch-up the budget cuts
        computes what is left of it (k = 0: it drafts nothing this step) and the rest wait."""
        out, budget = [], self.max_catch_up
        for req, start, k in sorted(work, key=lambda w: w[0].num_tokens - w[1]):
            need = req.num_tokens - self.shift - start
            if budget < min(need, 2):  # (a 1-token piece of a longer catch-up would pass for a decode)
                break
            if need > budget:
                out.append((req, start, 0, budget))
                break
            out.append((req, start, k, need))
            budget -= need
        return out

    def _sample(self, so: SchedulerOutput, prev: Optional[mx.array], reqs: list[Request], offset: int) -> mx.array:
        logits = self.runner.forward(so, prev)[:, :self.vocab_size]
        tokens = sample_draft_tokens(logits, reqs, offset)
        # Where MLX scatters the pages, the next forward's writes would copy a pool still referenced by
        # this one's pending graph: run each forward before building the next.
        (mx.async_eval if self.runner.pages_in_place else mx.eval)(tokens)
        return tokens

    def _batch(self, reqs: list[Request], starts: list[int], counts: list[int], input_ids: np.ndarray,
               placeholder_src: Optional[np.ndarray] = None) -> SchedulerOutput:
        """One draft forward's batch: each request's counts[i] tokens from position starts[i] (decodes
        first), every request's last row sampled; placeholder_src: inputs from the previous forward's tokens."""
        counts_np = np.asarray(counts, np.int32)
        qsl = np.zeros(len(reqs) + 1, np.int32)
        np.cumsum(counts_np, out=qsl[1:])
        token_req = np.repeat(np.arange(len(reqs), dtype=np.int32), counts_np)
        positions = (np.arange(int(qsl[-1]), dtype=np.int32) - qsl[token_req] + np.asarray(starts, np.int32)[token_req])
        tables = [self.manager.req_to_block_ids[r.request_id] for r in reqs]
        table = _block_table(tables, max(map(len, tables)))
        bs = self.block_size
        slots = table[token_req, positions // bs] * bs + positions % bs
        rows = np.arange(len(reqs), dtype=np.int32) if placeholder_src is not None else np.zeros(0, np.int32)
        return SchedulerOutput(
            req_ids=[r.request_id for r in reqs], num_scheduled_tokens=counts,
            num_decodes=sum(1 for c in counts if c == 1), input_ids=input_ids.astype(np.int32),
            positions=positions, slot_mapping=slots[None].astype(np.int32), query_start_loc=qsl,
            seq_lens=(np.asarray(starts, np.int32) + counts_np), block_table=table[None],
            logits_indices=qsl[1:] - 1, sampled_req_ids=[r.request_id for r in reqs],
            placeholder_rows=rows, placeholder_src=placeholder_src if placeholder_src is not None else rows)


def _vocab(tokenizer: Any) -> Optional[dict]:
    try:
        return dict(tokenizer.get_vocab())
    except Exception:  # noqa: BLE001 - a tokenizer without get_vocab: the vocabulary sizes were checked
        return None
