"""Requests: what the scheduler moves between its queues."""

from __future__ import annotations

import enum
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

from pagedmlx.sampling_params import MAX_SEED, SamplingParams

if TYPE_CHECKING:
    from pagedmlx.core.kv.block_hash import BlockHash
    from pagedmlx.lora.request import LoRARequest
    from pagedmlx.multimodal.inputs import MultiModalFeatureSpec

class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> Optional[str]:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence: its prompt, the tokens generated so far and how far its KV is computed."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
        mm_features: Optional[Sequence[MultiModalFeatureSpec]] = None,
    ):
        if not prompt_token_ids:
            raise ValueError("prompt must hold at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # the adapter its rows run with (pagedmlx/lora/), or None
        # Images: content hash, placeholder range in the prompt, processed inputs (pagedmlx/multimodal/), in order.
        self.mm_features: list[MultiModalFeatureSpec] = list(mm_features or ())
        self.status = RequestStatus.WAITING
        self.stop_reason: Any = None  # the stop token id or stop string that ended it
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by steps still running on the device (async scheduling): counted as if
        # known, so the next step can already be scheduled; their ids arrive with those steps.
        self.num_output_placeholders = 0
        self.placeholder_index = -1  # the newest placeholder's row in its step's sampled tokens
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache at first schedule
        self.num_preemptions = 0
        self.block_hashes: list[BlockHash] = []
        self.structured_output_request: Any = None  # guided decoding: its grammar (structured_outputs/manager.py)
        # Speculative decoding: draft tokens for the positions after its last token, proposed after the step
        # that sampled it (spec_decode/drafter.py); the next schedule verifies or drops them.
        self.spec_token_ids: list[int] = []
        # Unseeded requests get a random seed so that every row samples the same way.
        self.sampling_seed = (
            sampling_params.seed if sampling_params.seed is not None
            else int.from_bytes(os.urandom(8), "little") & MAX_SEED
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"computed={self.num_computed_tokens}, output={self.num_output_tokens})")


def fan_out(request_id: str, prompts: Sequence[Any], params: SamplingParams) -> list[tuple[str, Any, SamplingParams]]:
    """The engine requests of one API request: (id, prompt, params) for sample i of prompt p.
    One prompt with n == 1 keeps its id; otherwise child k = p * n + i is `{id}-{k}`, and seeded
    samples get seed + i (wrapping past MAX_SEED), so that the n samples of a prompt differ."""
    n = params.n
    if len(prompts) == 1 and n == 1:
        return [(request_id, prompts[0], params)]
    return [(f"{request_id}-{p * n + i}", prompt,
             replace(params, n=1, seed=None if params.seed is None else (params.seed + i) & MAX_SEED))
            for p, prompt in enumerate(prompts) for i in range(n)]
