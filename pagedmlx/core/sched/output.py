"""SchedulerOutput: one step's batch, flattened token-major, in vLLM's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Callable, Optional

import numpy as np

from pagedmlx.request import Request


@dataclass
class SchedulerOutput:
    """What the model runner needs for one forward pass over all scheduled tokens.

    Requests are ordered with single-token rows (decodes) first, then prefill chunks. Token-level
    arrays have one entry per scheduled token (T); request-level arrays one per request (B).
    """

    req_ids: list[str]
    num_scheduled_tokens: list[int]
    num_decodes: int  # the first num_decodes requests schedule exactly one token
    input_ids: np.ndarray  # (T,) token ids
    positions: np.ndarray  # (T,) position of each token in its sequence
    # A recurrent-state group (the last group, if any) holds one block per request: its state slot. Its
    # block_table row is [slot] and its slot_mapping gives each token its request's slot.
    slot_mapping: np.ndarray  # (G, T) per KV cache group: the page-pool slot each token's K/V is written to
    query_start_loc: np.ndarray  # (B + 1,) where each request's tokens start in the flat batch
    seq_lens: np.ndarray  # (B,) tokens of context after this step (cached + new)
    block_table: np.ndarray  # (G, B, max_blocks) per KV cache group: page ids per request, zero-padded
    # (S + R,) rows whose logits are needed: first the S rows sampled (the last token of caught-up
    # requests), then the R prompt rows of requests that asked for prompt logprobs.
    logits_indices: np.ndarray
    sampled_req_ids: list[str]
    # Async scheduling: rows whose input token is still on the device, and where it is in the
    # previous step's sampled tokens.
    placeholder_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    placeholder_src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    # Models with recurrent state: per request, the slot its state is read from (-1: none, the chunk
    # starts at position 0), the slot it is written to, a checkpoint slot (-1: none) and how many of the
    # request's scheduled tokens the checkpoint's state covers.
    state_slots: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.int32))  # (B, 4)
    # LoRA: per request, its adapter's lora_int_id (0: none); empty when no request has one.
    lora_int_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # (B,)
    # Prompt logprobs (SamplingParams.prompt_logprobs): per such request, the position of its first
    # row here and how many rows; each row's logits score the prompt token after it.
    prompt_logprob_req_ids: list[str] = field(default_factory=list)
    prompt_logprob_starts: list[int] = field(default_factory=list)
    prompt_logprob_lens: list[int] = field(default_factory=list)
    prompt_logprob_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # (R,)
    # Speculative decoding (vLLM's SpecDecodeMetadata): per sampled request, the draft tokens it verifies
    # (empty: none this step). A request with k drafts samples 1 + k rows in logits_indices: its last
    # token's row, then each draft's. draft_token_ids: all drafts, flat, in that order.
    num_draft_tokens: list[int] = field(default_factory=list)
    draft_token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    # Drafts still on the device (a draft model's: spec_decode/draft_model.DeviceDrafts): the flat array
    # their rows take their inputs from (as placeholder rows, in place of the previous step's tokens), where
    # each device draft is in it (draft_src) and in draft_token_ids (draft_pos: the others are a lookup's,
    # known on the host); those places of draft_token_ids hold zeros until resolve_drafts().
    device_drafts: Optional[object] = None
    draft_src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    draft_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)  # finished since the previous step
    # Images (pagedmlx/multimodal/): per request, those whose placeholder tokens this step computes (the runner
    # encodes the ones it does not hold and splices their rows), and the identifiers it drops once the step is built.
    mm_features: dict = field(default_factory=dict)  # request id -> [MultiModalFeatureSpec]
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # M-RoPE (multimodal/mrope.py), where a scheduled request has such images: each row's RoPE position (empty: the
    # positions above), and the rows of image tokens with their (t, h, w) positions.
    rope_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # (T,)
    mrope_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # (K,)
    mrope_positions: np.ndarray = field(default_factory=lambda: np.zeros((3, 0), np.int32))  # (3, K)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_sampled_rows(self) -> int:
        """Rows of logits_indices that sample (the rest score prompt tokens)."""
        return len(self.sampled_req_ids) + sum(self.num_draft_tokens)

    def resolve_drafts(self) -> None:
        """Read device drafts back into draft_token_ids (once the step that verifies them is computed)."""
        if self.device_drafts is not None:
            self.draft_token_ids = self.draft_token_ids.copy()
            self.draft_token_ids[self.draft_pos] = np.asarray(self.device_drafts)[self.draft_src]
            self.device_drafts = None

    def inline_drafts(self) -> None:
        """Read device drafts back now (a wait) and put them in input_ids, for a runner that needs every
        input token on the host (tensor parallelism)."""
        if self.device_drafts is not None:
            rows = self.placeholder_rows
            self.resolve_drafts()
            self.input_ids[rows] = self.draft_token_ids[self.draft_pos]
            self.placeholder_rows = self.placeholder_src = self.draft_src = self.draft_pos = np.zeros(0, np.int32)

    @property
    def scheduled_spec_decode_tokens(self) -> dict[str, list[int]]:
        """vLLM's view: the draft tokens of each request that verifies some."""
        out, at = {}, 0
        for rid, k in zip(self.sampled_req_ids, self.num_draft_tokens):
            if k:
                out[rid] = self.draft_token_ids[at:at + k].tolist()
                at += k
        return out

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def is_empty(self) -> bool:
        return not self.req_ids

    @classmethod
    def empty(cls, finished_req_ids: set[str], preempted_req_ids: list[str]) -> "SchedulerOutput":
        z = np.zeros(0, np.int32)
        return cls([], [], 0, z, z, np.zeros((1, 0), np.int32), np.zeros(1, np.int32), z,
                   np.zeros((1, 0, 1), np.int32), z, [],
                   preempted_req_ids=preempted_req_ids, finished_req_ids=finished_req_ids)


def build_scheduler_output(
    scheduled: list[tuple[Request, int]],
    get_block_ids: Callable[[str], tuple[list[int], ...]],
    block_size: int,
    preempted_req_ids: list[str],
    finished_req_ids: set[str],
    get_state_slots: Optional[Callable[[Request], tuple[int, int, int, int]]] = None,
    spec_decode_tokens: Optional[dict[str, list[int]]] = None,
) -> SchedulerOutput:
    """Flatten the step's (request, num_new_tokens) pairs, read before num_computed_tokens advances.
    get_state_slots: for a model with recurrent state, whose state group is the last group.
    spec_decode_tokens: the draft tokens scheduled per request id (its last num_new_tokens)."""
    if not scheduled:
        return SchedulerOutput.empty(finished_req_ids, preempted_req_ids)
    scheduled = sorted(scheduled, key=lambda rn: rn[1] != 1)  # stable: decodes first
    num_decodes = sum(1 for _, n in scheduled if n == 1)
    req_ids, counts, tokens, starts, seq_lens, tables, state_slots = [], [], [], [], [], [], []
    logits_indices, sampled_req_ids = [], []
    placeholder_rows, placeholder_src = [], []
    prompt_rows, prompt_tokens, prompt_reqs = [], [], ([], [], [])
    num_drafts, draft_ids, draft_src, draft_pos, device_drafts = [], [], [], [], None
    row = 0
    for req, n in scheduled:
        start = req.num_computed_tokens
        end = start + n
        req_ids.append(req.request_id)
        counts.append(n)
        starts.append(start)
        seq_lens.append(end)
        tables.append(get_block_ids(req.request_id))
        if get_state_slots is not None:
            state_slots.append(get_state_slots(req))
        known = req.num_tokens
        drafts = spec_decode_tokens.get(req.request_id, ()) if spec_decode_tokens else ()
        if n == 1 and start < known:
            tokens.append(req.all_token_ids[start])
        else:
            tokens.extend(req.all_token_ids[start:min(end, known)])
            if drafts:  # scheduled only after every known token (never behind a placeholder)
                tokens.extend(drafts)
                src = getattr(drafts, "src", None)  # drafts still on the device: placeholder rows
                if src is not None:
                    if device_drafts is not None and device_drafts is not drafts.tokens:
                        raise RuntimeError("a step's device drafts come from two proposals")
                    device_drafts = drafts.tokens
                    first = row + n - len(drafts)
                    placeholder_rows.extend(range(first, first + len(drafts)))
                    placeholder_src.extend(src)
                    draft_src.extend(src)
            elif end > known:  # the last token was sampled by the step still in flight
                tokens.append(0)
                placeholder_rows.append(row + n - 1)
                placeholder_src.append(req.placeholder_index)
        if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
            last = min(end, req.num_prompt_tokens - 1)  # the prompt's last row scores the first output
            prompt_rows.extend(range(row, row + last - start))
            prompt_tokens.extend(req.prompt_token_ids[start + 1:last + 1])
            for acc, value in zip(prompt_reqs, (req.request_id, start, last - start)):
                acc.append(value)
        row += n
        if end == req.num_tokens_with_placeholders + len(drafts):
            logits_indices.extend(range(row - 1 - len(drafts), row))
            sampled_req_ids.append(req.request_id)
            num_drafts.append(len(drafts))
            if getattr(drafts, "src", None) is not None:
                draft_pos.extend(range(len(draft_ids), len(draft_ids) + len(drafts)))
            draft_ids.extend(drafts)

    if device_drafts is not None and len(placeholder_src) != len(draft_src):
        raise RuntimeError("a step with device drafts has tokens in flight too (speculating steps never overlap)")
    counts_np = np.asarray(counts, np.int32)
    query_start_loc = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts_np, out=query_start_loc[1:])
    seq_lens_np = np.asarray(seq_lens, np.int32)

    total = int(query_start_loc[-1])
    token_req = np.repeat(np.arange(len(counts), dtype=np.int32), counts_np)
    positions = (np.arange(total, dtype=np.int32) - query_start_loc[token_req]
                 + np.asarray(starts, np.int32)[token_req])
    width = max(max(map(len, t)) for t in tables)
    block_table = np.stack([_block_table([t[g] for t in tables], width) for g in range(len(tables[0]))])
    # Per-token slots in each group, vectorised over the whole batch.
    num_paged = len(block_table) - (get_state_slots is not None)
    slot_mapping = [block_table[num_paged:, token_req, 0]]
    if num_paged:
        slot_mapping.insert(0, block_table[:num_paged, token_req, positions // block_size] * block_size
                            + positions % block_size)
    slot_mapping = np.concatenate(slot_mapping)

    return SchedulerOutput(
        req_ids=req_ids,
        num_scheduled_tokens=counts,
        num_decodes=num_decodes,
        input_ids=np.asarray(tokens, np.int32),
        positions=positions.astype(np.int32),
        slot_mapping=slot_mapping.astype(np.int32),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_np,
        block_table=block_table,
        logits_indices=np.asarray(logits_indices + prompt_rows, np.int32),
        sampled_req_ids=sampled_req_ids,
        placeholder_rows=np.asarray(placeholder_rows, np.int32),
        placeholder_src=np.asarray(placeholder_src, np.int32),
        state_slots=np.asarray(state_slots, np.int32).reshape(-1, 4),
        lora_int_ids=_lora_int_ids([req for req, _ in scheduled]),
        prompt_logprob_req_ids=prompt_reqs[0],
        prompt_logprob_starts=prompt_reqs[1],
        prompt_logprob_lens=prompt_reqs[2],
        prompt_logprob_tokens=np.asarray(prompt_tokens, np.int32),
        num_draft_tokens=num_drafts if draft_ids else [],
        draft_token_ids=np.asarray(draft_ids, np.int32),
        device_drafts=device_drafts,
        draft_src=np.asarray(draft_src, np.int32),
        draft_pos=np.asarray(draft_pos, np.int32),
        preempted_req_ids=preempted_req_ids,
        finished_req_ids=finished_req_ids,
    )


def decode_only_output(batch: int, context: int, block_size: int) -> SchedulerOutput:
    """A step of `batch` decode rows, each at `context` tokens over its own consecutive blocks (request b
    on blocks b * ceil(context / block_size) onward): what `pagedmlx doctor` and the benchmarks time."""
    from pagedmlx.sampling_params import SamplingParams

    per_seq = -(-context // block_size)
    reqs = []
    for b in range(batch):
        r = Request(f"d{b}", [1] * context, SamplingParams(max_tokens=2))
        r.num_computed_tokens = context - 1
        reqs.append(r)
    tables = {r.request_id: (list(range(b * per_seq, (b + 1) * per_seq)),) for b, r in enumerate(reqs)}
    return build_scheduler_output([(r, 1) for r in reqs], tables.__getitem__, block_size, [], set())

def _lora_int_ids(requests: list[Request]) -> np.ndarray:
    ids = [r.lora_request.lora_int_id if r.lora_request is not None else 0 for r in requests]
    return np.asarray(ids, np.int32) if any(ids) else np.zeros(0, np.int32)


def _block_table(tables: list[list[int]], width: int) -> np.ndarray:
    """(B, width) from each request's block ids, zero-padded."""
    table_lens = np.fromiter(map(len, tables), np.int32, len(tables))
    block_table = np.zeros((len(tables), max(width, 1)), np.int32)
    block_table[np.arange(block_table.shape[1]) < table_lens[:, None]] = np.fromiter(
        chain.from_iterable(tables), np.int32, int(table_lens.sum()))
    return block_table
