"""Verifying draft tokens (vLLM's RejectionSampler, for drafts that are a single proposed token each,
as the n-gram proposer's and the draft model's are).

The sampler samples every row of a request with k drafts d_1..d_k: row j (j = 0..k) gives the target's
token t_j for the position after the request's tokens and the drafts before it. Kept: t_0 .. t_a,
where a is the first j with t_j != d_{j+1} (a = k when all agree: t_k is the bonus token).

- Greedy: t_j is the target's argmax: drafts are accepted while they equal it, then the target's
  token follows. Exactly the tokens of non-speculative greedy decoding.
- Temperature > 0: t_j = argmax(x_j + g_j), x_j the row's filtered, temperature-scaled logits and g_j
  Gumbel noise of the request's seed at output position n + j (sample/sampler.py). That is the rejection
  sampler for a point-mass draft q = delta(d): P(t_j = d) = p(d), so d is accepted with probability
  p(d) = min(1, p(d) / q(d)); given t_j != d, t_j is distributed as p with d removed, renormalised
  (the Gumbel-max argmax restricted to the other tokens), which is the residual norm(max(0, p - q)).
  The kept tokens therefore follow the target distribution (Leviathan et al. 2023; Chen et al. 2023)
  and, since the noise depends only on (seed, position), a seeded request gives the very tokens it
  gives without speculation (the same coupling vLLM's recovered-token sampling reaches only in law).
  A draft model (draft_model.py) proposes with a distribution q of its own, but as a point mass all
  the same: its token is argmax(y_j + g_j), its own processed logits y_j with the very noise g_j that
  the target's row j draws (sampler.sample_draft_tokens). The kept tokens are still the target's own
  samples, so the law above holds whatever q is; q only decides how often the draft is accepted: with
  the noise shared (a Gumbel-max coupling), always when q = p, and with probability at least
  (1 - TV) / (1 + TV), TV the total variation between p and q, otherwise (the general rule, accept with
  min(1, p / q) and recover from norm(max(0, p - q)), gets 1 - TV; it would give up seeded tokens).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def num_accepted(target: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens of their rows."""
    a = 0
    for t, d in zip(target, drafts):
        if t != d:
            break
        a += 1
    return a


def verify(token_ids: Sequence[int], num_draft_tokens: Sequence[int], draft_token_ids: np.ndarray
           ) -> tuple[list[list[int]], list[int]]:
    """Per request, the tokens kept (t_0 .. t_a) from all rows' sampled `token_ids`, and each request's
    first row in them."""
    kept, starts = [], []
    row = at = 0
    drafts = draft_token_ids.tolist()
    for k in num_draft_tokens:
        rows = token_ids[row:row + k + 1]
        a = num_accepted(rows, drafts[at:at + k])
        kept.append(list(rows[:a + 1]))
        starts.append(row)
        row += k + 1
        at += k
    return kept, starts
