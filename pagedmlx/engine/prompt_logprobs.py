"""Prompt logprobs (vLLM's `prompt_logprobs`): a step's prompt rows score the prompt token after each, and
a completed step's scores are filed under their requests until the first output carries them."""

from __future__ import annotations

import mlx.core as mx

from pagedmlx.engine.step import LaunchedStep
from pagedmlx.outputs import TokenLogprob
from pagedmlx.sample.sampler import Sampler, SamplerOutput
from pagedmlx.core.sched.output import SchedulerOutput


def prompt_logprobs(logits: mx.array, so: SchedulerOutput, requests: dict) -> SamplerOutput:
    """Each prompt row's logprob of the prompt token after it, and its top k (the model's raw logits, as
    vLLM: no bias, penalty or temperature). requests: the scheduler's, by id."""
    ks = []
    for rid, n in zip(so.prompt_logprob_req_ids, so.prompt_logprob_lens):
        ks += [requests[rid].sampling_params.prompt_logprobs] * n
    out = SamplerOutput(mx.array(so.prompt_logprob_tokens), num_logprobs=ks)
    Sampler.compute_logprobs(logits.astype(mx.float32), out, max(ks))
    return out


def record_prompt_logprobs(step: LaunchedStep, requests: dict, filed: dict[str, list[TokenLogprob]]) -> None:
    """File a completed step's prompt logprobs under their requests in `filed` (each position once: a
    preempted request computes its prompt again; a request id reused since the step files nothing)."""
    so, rows = step.so, iter(step.prompt_rows)
    scheduled = dict(zip(so.req_ids, step.requests))
    for rid, start, n in zip(so.prompt_logprob_req_ids, so.prompt_logprob_starts, so.prompt_logprob_lens):
        acc = filed.get(rid) if requests.get(rid) is scheduled[rid] else None
        for pos in range(start, start + n):
            row = next(rows)
            if acc is not None and len(acc) == pos:
                acc.append(TokenLogprob(row.token_id, row.logprob, row.top_logprobs or []))
