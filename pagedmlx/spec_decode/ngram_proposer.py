"""NgramProposer (vLLM's "ngram" method, prompt lookup decoding): the draft is what followed the most
recent earlier occurrence of the context's last n tokens, for the largest n in
[prompt_lookup_min, prompt_lookup_max] that occurs earlier at all.

vLLM matches with KMP over the reversed context (numba) and takes the earliest occurrence of the
longest n-gram; here the most recent one (what a quoted passage repeats is usually what was quoted
last), vectorised in numpy: one comparison over the last MAX_LOOKBACK tokens of the context, then
work on the few matches only. Contexts live in per-request numpy buffers that grow with the output, so
a step copies only its new tokens."""

from __future__ import annotations

import weakref
from typing import Sequence

import numpy as np

MAX_LOOKBACK = 8192  # tokens searched back from the end of a context (one search: ~15 us at 8k on a 2-core x86)


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to k tokens following the most recent earlier occurrence of the longest suffix n-gram of
    `tokens` (min_n <= n <= max_n); empty when none occurs earlier. An occurrence may overlap the
    suffix itself ([..., a, a, a] proposes a's)."""
    L = len(tokens)
    if L <= min_n or k <= 0:
        return tokens[:0]
    # Candidate ends e < L - 1 of an earlier occurrence, narrowed one token further back at a time:
    # one O(L) comparison, then work only on the survivors.
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])
    found, n = ends, 1
    for j in range(1, min(max_n, L - 1)):
        ends = ends[ends >= j]
        ends = ends[tokens[ends - j] == tokens[L - 1 - j]]
        if not len(ends):
            break
        found, n = ends, j + 1
    if n < min_n or not len(found):
        return tokens[:0]
    e = int(found[-1])  # the most recent occurrence of the longest n-gram
    return tokens[e + 1:e + 1 + k]


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        # Per request: (numpy buffer of its tokens, how many are in it). Gone with the request.
        self._contexts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def context(self, request) -> np.ndarray:
        """The request's tokens (prompt + output) as a numpy view, grown in place (amortised O(new))."""
        ids: Sequence[int] = request.all_token_ids
        buf, n = self._contexts.get(request, (None, 0))
        if buf is None or len(buf) < len(ids):
            grown = np.empty(max(64, 2 * len(ids)), np.int64)
            if buf is not None:
                grown[:n] = buf[:n]
            buf = grown
        if n < len(ids):
            buf[n:len(ids)] = ids[n:]
        self._contexts[request] = (buf, len(ids))
        return buf[:len(ids)]

    def propose(self, request, max_tokens: int) -> list[int]:
        """At most min(k, max_tokens) draft tokens for the request's next positions."""
        ctx = self.context(request)
        return find_ngram_draft(ctx[-MAX_LOOKBACK:], self.min_n, self.max_n, min(self.k, max_tokens)).tolist()
