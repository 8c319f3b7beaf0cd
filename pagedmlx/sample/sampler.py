"""Batched sampling: one vectorised call per step for rows with different sampling parameters.

Per row, in vLLM v1's order (all in float32):
  logit_bias -> repetition penalty (prompt + output tokens) -> frequency and presence penalties
  (output tokens) -> guided rows: the grammar's bitmask (disallowed tokens to -inf) = the *processed*
  logits. Greedy rows (temperature 0) take their argmax.
  Sampled rows: / temperature -> min_p -> top_k -> top_p (over what top_k kept, renormalised)
  -> argmax(logits + Gumbel noise) over the tokens still allowed.
Logprobs are log_softmax of the processed logits, before temperature/min_p/top_k/top_p: the
model's distribution with the penalties and bias the user asked for, whatever way it samples. For a
guided row that is the distribution over the tokens its grammar allows (renormalised; the others
-inf), as vLLM, which masks the logits before its sampler computes logprobs.
Top-k/top-p cut by value: tokens tied with the last kept value are kept too.

Randomness is a counter-based hash, noise[r, v] = hash(seed_r, step_r, v) with step_r the number
of tokens request r has sampled so far: a seeded request draws the same tokens whatever else is in
the batch, and MLX's global random state is never used.

Speculative decoding: a request with k draft tokens has 1 + k rows, row j the target's distribution
at its output position n + j (step n + j); every row samples as above. sample/rejection_sampler.py
says how the drafts are then accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional, Sequence

import mlx.core as mx
import numpy as np

from pagedmlx.request import Request

_U32 = 0xFFFFFFFF


@dataclass
class SamplerOutput:
    sampled_token_ids: mx.array  # (S,) int32
    logprobs: Optional[mx.array] = None  # (S,) float32, the sampled token's; None if no row asked
    top_token_ids: Optional[mx.array] = None  # (S, K) int32, K = most logprobs asked (0 -> None)
    top_logprobs: Optional[mx.array] = None  # (S, K) float32, sorted descending
    num_logprobs: list[Optional[int]] = field(default_factory=list)  # host side: what each row asked


class SampledToken(NamedTuple):
    token_id: int
    logprob: Optional[float]  # None when the request did not ask for logprobs
    top_logprobs: Optional[list[tuple[int, float]]]  # its own k entries, best first


def to_host(out: SamplerOutput) -> list[SampledToken]:
    """The step's single host sync: evaluate every output array at once, then split per row."""
    arrays = [out.sampled_token_ids, out.logprobs, out.top_token_ids, out.top_logprobs]
    mx.eval(*[a for a in arrays if a is not None])
    ids, lps, top_ids, top_lps = (a.tolist() if a is not None else None for a in arrays)
    rows = []
    for i, tok in enumerate(ids):
        k = out.num_logprobs[i] if out.num_logprobs else None
        if k is None:
            rows.append(SampledToken(tok, None, None))
        else:
            top = list(zip(top_ids[i][:k], top_lps[i][:k])) if k and top_ids is not None else []
            rows.append(SampledToken(tok, lps[i], top))
    return rows


def _fmix32(h: mx.array) -> mx.array:
    """murmur3's 32-bit finalizer: a bijection on uint32 with full avalanche."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


def gumbel_noise(seeds: Sequence[int], steps: Sequence[int], vocab_size: int) -> mx.array:
    """(S, V) float32 Gumbel(0, 1) noise; row r depends only on (seeds[r], steps[r])."""
    lo = mx.array([s & _U32 for s in seeds], dtype=mx.uint32)[:, None]
    hi = mx.array([(s >> 32) & _U32 for s in seeds], dtype=mx.uint32)[:, None]
    step = mx.array([t & _U32 for t in steps], dtype=mx.uint32)[:, None]
    # Two 32-bit row keys; (k1, k2) is a bijection of the 64-bit seed for a given step.
    k1 = _fmix32(lo ^ _fmix32(step + 0x9E3779B9))
    k2 = _fmix32(hi ^ _fmix32(k1 + 0x7F4A7C15))
    h = _fmix32(_fmix32(mx.arange(vocab_size, dtype=mx.uint32)[None, :] + k1) + k2)
    # 23 bits -> u in (0, 1) exactly representable in float32 (never 0 or 1).
    u = ((h >> 9).astype(mx.float32) + 0.5) * (1.0 / (1 << 23))
    return -mx.log(-mx.log(u))


def apply_bias_and_penalties(logits: mx.array, requests: Sequence[Request]) -> mx.array:
    """Processed float32 logits: logit_bias, then repetition, frequency and presence penalties.

    Token ids >= V (in logit_bias or in the token history) are ignored: requests are validated
    against the tokenizer's vocabulary elsewhere; this only keeps a bad id from crashing a step.
    """
    logits = logits.astype(mx.float32)
    V = logits.shape[-1]
    params = [r.sampling_params for r in requests]
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items() if t < V]
    if bias:
        rows, toks, vals = zip(*bias)
        logits = logits.at[mx.array(rows), mx.array(toks)].add(mx.array(vals, dtype=mx.float32))

    pen = [i for i, p in enumerate(params) if p.has_penalties]
    if not pen:
        return logits
    # Only the rows with penalties: count planes (P, V), plane 0 output tokens, plane 1 (only if
    # some row has a repetition penalty) its prompt tokens; built by one scatter-add.
    rep = [params[i].repetition_penalty for i in pen]
    planes, rows, toks = [], [], []
    for j, i in enumerate(pen):
        hist = [requests[i].output_token_ids] + ([requests[i].prompt_token_ids] if rep[j] != 1.0 else [])
        for plane, ids in enumerate(hist):
            toks.append(np.asarray(ids, dtype=np.int64))
            rows.append(np.full(len(ids), j))
            planes.append(np.full(len(ids), plane))
    planes, rows, toks = (np.concatenate(a) for a in (planes, rows, toks))
    ok = (toks >= 0) & (toks < V)
    counts = mx.zeros((2 if any(r != 1.0 for r in rep) else 1, len(pen), V), dtype=mx.float32)
    if ok.any():
        counts = counts.at[tuple(mx.array(a[ok].astype(np.int32)) for a in (planes, rows, toks))].add(1.0)

    idx = mx.array(pen) if len(pen) < len(params) else None
    x = logits[idx] if idx is not None else logits
    if counts.shape[0] == 2:
        r = mx.array(rep, dtype=mx.float32)[:, None]
        x = mx.where(counts.sum(axis=0) > 0, mx.where(x > 0, x / r, x * r), x)
    freq = [params[i].frequency_penalty for i in pen]
    pres = [params[i].presence_penalty for i in pen]
    if any(freq):
        x = x - mx.array(freq, dtype=mx.float32)[:, None] * counts[0]
    if any(pres):
        x = x - mx.array(pres, dtype=mx.float32)[:, None] * (counts[0] > 0)
    if idx is None:
        return x
    logits[idx] = x
    return logits


_NEG_INF_BITS = 0xFF800000  # float32 -inf's bit pattern


def apply_grammar_bitmask(logits: mx.array, rows: np.ndarray, words: np.ndarray) -> mx.array:
    """Guided decoding: rows[i]'s tokens whose bit is clear in words[i] (int32, 32 tokens a word, bit
    t % 32 of word t // 32) to -inf, on the device; other rows untouched. Token ids past the words'
    end (a model's padded rows) are disallowed.

    Written for MLX's CPU backend, where ternary ops (mx.where) and scatters run an element at a
    time: the words unpack to 0/1 by shifts, (1 - bit) * 0xFF800000 viewed as float32 is 0.0 or
    -inf, and that bias is added (x + 0.0 == x): 64 x 49k logits in ~10 ms on a 2-core x86, against
    ~40 ms with mx.where."""
    V = logits.shape[1]
    words = np.asarray(words).view(np.uint32)
    if words.shape[1] * 32 < V:
        words = np.pad(words, ((0, 0), (0, -(-V // 32) - words.shape[1])))
    bits = mx.right_shift(mx.array(words)[:, :, None], mx.arange(32, dtype=mx.uint32)) & 1
    bias = mx.view((1 - bits) * _NEG_INF_BITS, mx.float32).reshape(len(rows), -1)[:, :V]
    if len(rows) == logits.shape[0]:
        return logits + bias
    return logits.at[mx.array(rows)].add(bias)


def _allowed(x: mx.array, top_k: list[int], top_p: list[float], min_p: list[float]) -> mx.array:
    """x (temperature-scaled) with the tokens outside min_p / top_k / top_p set to -inf."""
    V = x.shape[1]
    if any(m > 0 for m in min_p):  # p >= min_p * p_max  <=>  x >= x_max + log(min_p)
        floor = x.max(axis=-1, keepdims=True) + mx.log(mx.array(min_p, dtype=mx.float32))[:, None]
        x = mx.where(x >= floor, x, -mx.inf)
    use_k, use_p = any(k < V for k in top_k), any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return x
    srt = -mx.sort(-x, axis=-1)  # descending
    keep = mx.array(top_k, dtype=mx.int32)  # how many ranks survive, per row
    if use_p:
        srt_k = mx.where(mx.arange(V)[None, :] < keep[:, None], srt, -mx.inf)
        probs = mx.softmax(srt_k, axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs  # mass strictly ahead of each rank
        p = mx.array(top_p, dtype=mx.float32)
        n_p = (before < p[:, None]).sum(axis=-1).astype(mx.int32)  # >= 1: before[0] = 0 < p
        keep = mx.where(p < 1.0, mx.minimum(keep, n_p), keep)
    thresh = mx.take_along_axis(srt, (keep - 1)[:, None], axis=-1)
    return mx.where(x >= thresh, x, -mx.inf)


def _sample_random(logits: mx.array, requests: Sequence[Request], offsets: Optional[Sequence[int]] = None) -> mx.array:
    """argmax(logits / T + Gumbel noise) over each row's allowed tokens. Greedy rows run with
    neutral parameters (T = 1, no filters); the caller replaces their result by the plain argmax.
    offsets: per row, how many tokens after the request's next one it samples (draft rows)."""
    V = logits.shape[1]
    params = [None if r.sampling_params.greedy else r.sampling_params for r in requests]
    temps = [p.temperature if p else 1.0 for p in params]
    x = logits
    if any(t != 1.0 for t in temps):
        x = x / mx.array(temps, dtype=mx.float32)[:, None]
    x = _allowed(x, top_k=[p.top_k if p and 0 < p.top_k < V else V for p in params],
                 top_p=[p.top_p if p else 1.0 for p in params], min_p=[p.min_p if p else 0.0 for p in params])
    steps = [r.num_output_tokens + r.num_output_placeholders for r in requests]
    if offsets is not None:
        steps = [s + j for s, j in zip(steps, offsets)]
    noise = gumbel_noise([r.sampling_seed for r in requests], steps, V)
    return mx.argmax(x + noise, axis=-1)


def _draft_rows(requests: Sequence[Request], num_draft_tokens: Sequence[int], bitmask):
    """Per row: its request and its offset after the request's next token; the bitmask's rows (guided
    requests, which never draft) moved to their requests' rows."""
    rows = [r for r, k in zip(requests, num_draft_tokens) for _ in range(k + 1)]
    offsets = [j for k in num_draft_tokens for j in range(k + 1)]
    if bitmask is not None:
        first = np.cumsum([0, *(k + 1 for k in num_draft_tokens)])[:-1]
        bitmask = replace(bitmask, rows=first[bitmask.rows].astype(np.int32))
    return rows, offsets, bitmask


def sample_draft_tokens(logits: mx.array, requests: Sequence[Request], offset: int) -> mx.array:
    """A draft model's token for each request's position `offset` tokens after its next one
    (spec_decode/draft_model.py): sampled as the target's row for that position will be (its bias,
    temperature, filters) and with the very Gumbel noise that row will draw, so that where the draft's
    distribution is close to the target's, the two argmaxes coincide (a Gumbel-max coupling). Greedy
    requests take the argmax. Requests that draft have no penalties or grammar (spec_decode/drafter.py)."""
    logits = apply_bias_and_penalties(logits, requests)
    greedy = [r.sampling_params.greedy for r in requests]
    if all(greedy):
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    tokens = _sample_random(logits, requests, [offset] * len(requests))
    if any(greedy):
        tokens = mx.where(mx.array(greedy), mx.argmax(logits, axis=-1), tokens)
    return tokens.astype(mx.int32)


class Sampler:
    """One call per step: sampled tokens (and logprobs) for rows with different parameters."""

    def __call__(self, logits: mx.array, requests: Sequence[Request], grammar_bitmask=None,
                 num_draft_tokens: Optional[Sequence[int]] = None) -> SamplerOutput:
        """grammar_bitmask: the guided rows' masks (structured_outputs.manager.GrammarBitmask) or None.
        num_draft_tokens: per request, its draft tokens (speculative decoding): it has 1 + k rows."""
        offsets = None
        if num_draft_tokens and any(num_draft_tokens):
            requests, offsets, grammar_bitmask = _draft_rows(requests, num_draft_tokens, grammar_bitmask)
        if logits.ndim != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits {logits.shape} do not match {len(requests)} rows")
        if not requests:
            return SamplerOutput(mx.zeros((0,), dtype=mx.int32))
        V = logits.shape[1]
        params = [r.sampling_params for r in requests]
        logits = apply_bias_and_penalties(logits, requests)
        if grammar_bitmask is not None:
            logits = apply_grammar_bitmask(logits, grammar_bitmask.rows, grammar_bitmask.words)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = mx.argmax(logits, axis=-1)
        else:
            tokens = _sample_random(logits, requests, offsets)
            if any(greedy):
                tokens = mx.where(mx.array(greedy), mx.argmax(logits, axis=-1), tokens)
        out = SamplerOutput(tokens.astype(mx.int32), num_logprobs=[p.logprobs for p in params])
        if any(k is not None for k in out.num_logprobs):
            self.compute_logprobs(logits, out, min(V, max(k or 0 for k in out.num_logprobs)))
        return out

    @staticmethod
    def compute_logprobs(logits: mx.array, out: SamplerOutput, k: int) -> None:
        """The logprob of each row's out.sampled_token_ids, and the k best of each row, into `out`."""
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out.logprobs = mx.take_along_axis(lp, out.sampled_token_ids[:, None], axis=-1)[:, 0]
        if k:
            idx = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
            vals = mx.take_along_axis(lp, idx, axis=-1)
            order = mx.argsort(-vals, axis=-1)
            out.top_token_ids = mx.take_along_axis(idx, order, axis=-1).astype(mx.int32)
            out.top_logprobs = mx.take_along_axis(vals, order, axis=-1)
