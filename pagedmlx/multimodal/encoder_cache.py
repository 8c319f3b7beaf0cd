"""The encoder cache's accounting in the scheduler (vLLM's EncoderCacheManager): which images' embeddings the
runner holds, for which requests, and how many image tokens a step may encode (the encoder budget).

An image is encoded whole the first time a step schedules any of its placeholder tokens; its embeddings stay
(keyed by its content hash) while a request still has placeholder tokens of it to compute, so a chunked prefill
splices the rest from the cache and two requests with the same image encode it once. The runner holds the arrays
(multimodal/runner.py); it encodes whatever a step needs that it does not hold, and drops what
SchedulerOutput.free_encoder_mm_hashes names once that step is built."""

from __future__ import annotations

from typing import Any, Iterator, Optional

from pagedmlx.multimodal.inputs import MultiModalFeatureSpec
from pagedmlx.multimodal.mrope import step_rope_positions, uses_mrope
from pagedmlx.request import Request


def overlapping(features: list[MultiModalFeatureSpec], start: int, end: int) -> Iterator[MultiModalFeatureSpec]:
    """The images (features in prompt order) with placeholder tokens among positions [start, end)."""
    for f in features:
        if f.mm_position.offset >= end:
            return
        if f.mm_position.end > start:
            yield f


class EncoderCacheManager:
    def __init__(self, encoder_budget: int):
        """encoder_budget: image tokens a step may encode (an image larger than it still goes, alone in its step)."""
        self.encoder_budget = encoder_budget
        self.cached: dict[str, set[str]] = {}  # identifier -> ids of the requests that still need it
        self._freed: list[str] = []
        self._step_encoded: set[str] = set()
        self._step_budget = encoder_budget
        self._step_images = False  # a request trimmed this step reaches an image's tokens
        self.mrope_requests: set[str] = set()  # unfinished requests whose images take M-RoPE positions
        # An image's tokens attend each other both ways (Gemma 4 use_bidirectional_attention="vision"): every image
        # is computed whole in one step (vLLM's rule for bidirectional encoder outputs), a prefix hit never ends
        # inside one.
        self.whole_images = False

    @property
    def needs_update(self) -> bool:
        """This step reaches image tokens or has images to drop: update() fills its output (text-only steps skip
        it)."""
        return self._step_images or bool(self._freed)

    def begin_step(self) -> None:
        self._step_encoded, self._step_budget, self._step_images = set(), self.encoder_budget, False

    def trim(self, request: Request, num_computed: int, num_new_tokens: int, uncapped: Optional[int] = None) -> int:
        """num_new_tokens cut, where needed, so that the images whose tokens it reaches can be encoded this step:
        those not cached cost their length of the step's budget; the first image past the budget ends the chunk
        before its placeholder (unless it is the step's first image: any image can be encoded alone). With
        whole_images, a chunk that would end inside an image ends before it; one that would then be empty takes
        the image whole past long_prefill_token_threshold's cap (up to `uncapped`, the budget's), else an image
        longer than the cap would wait for every decode to end."""
        if self.whole_images:
            n = whole_image_cut(request.mm_features, num_computed, num_new_tokens)
            if n == 0 and uncapped is not None and uncapped > num_new_tokens:
                n = whole_image_cut(request.mm_features, num_computed, uncapped)
                if n > num_new_tokens:  # only this image past the cap, not the text after it
                    n = next(hi for lo, hi in image_blocks(request.mm_features)
                             if lo <= num_computed + num_new_tokens < hi) - num_computed
            num_new_tokens = n
            return whole_image_cut(request.mm_features, num_computed, self._trim(request, num_computed, num_new_tokens))
        return self._trim(request, num_computed, num_new_tokens)

    def _trim(self, request: Request, num_computed: int, num_new_tokens: int) -> int:
        for f in overlapping(request.mm_features, num_computed, num_computed + num_new_tokens):
            pos = f.mm_position
            self._step_images = True
            if f.identifier in self.cached or f.identifier in self._step_encoded:
                continue
            if pos.length > self._step_budget and self._step_encoded:
                return max(0, pos.offset - num_computed)
            self._step_budget -= pos.length
            self._step_encoded.add(f.identifier)
        return num_new_tokens

    def image_start_before(self, request: Request, num_tokens: int) -> int:
        """With whole_images: num_tokens cut back to the start of the image it ends inside (else unchanged)."""
        if self.whole_images:
            for lo, hi in image_blocks(request.mm_features):
                if lo < num_tokens < hi:
                    return lo
        return num_tokens

    def update(self, scheduled: list[tuple[Request, int]]) -> tuple[dict[str, list[MultiModalFeatureSpec]], list[str]]:
        """After the step is scheduled (before num_computed_tokens advances): per request, the images whose tokens
        the step computes (the runner's SchedulerOutput.mm_features), and the identifiers the runner may drop once
        the step is built (no request needs them after it)."""
        step: dict[str, list[MultiModalFeatureSpec]] = {}
        done: list[tuple[str, str]] = []
        for req, n in scheduled:
            end = req.num_computed_tokens + n
            for f in overlapping(req.mm_features, req.num_computed_tokens, end):
                step.setdefault(req.request_id, []).append(f)
                self.cached.setdefault(f.identifier, set()).add(req.request_id)
                if f.mm_position.end <= end:
                    done.append((f.identifier, req.request_id))
        for identifier, rid in done:
            self._release(identifier, rid)
        return step, self.take_freed()

    def add_request(self, request: Request) -> None:
        if self.whole_images:  # each image in one step: it must fit a step's tokens (ValueError before it is added)
            longest = max((hi - lo for lo, hi in image_blocks(request.mm_features)), default=0)
            if longest > self.encoder_budget:
                raise ValueError(f"an image of {longest} tokens must be computed in one step, which takes at most "
                                 f"{self.encoder_budget} (max_num_batched_tokens)")
        if uses_mrope(request.mm_features):
            self.mrope_requests.add(request.request_id)

    def rope_positions(self, out: Any, requests: dict[str, Request]) -> None:
        """A step's M-RoPE positions (multimodal/mrope.py), where one of its requests has such images."""
        features = [requests[rid].mm_features if rid in self.mrope_requests else [] for rid in out.req_ids]
        if any(features):
            out.rope_positions, out.mrope_rows, out.mrope_positions = step_rope_positions(
                out.positions, out.query_start_loc, features)

    def free(self, request: Request) -> None:
        """The request finished or was preempted: it needs none of its images (a preempted one encodes again)."""
        if request.is_finished:
            self.mrope_requests.discard(request.request_id)
        for f in request.mm_features:
            self._release(f.identifier, request.request_id)

    def take_freed(self) -> list[str]:
        freed = [i for i in dict.fromkeys(self._freed) if i not in self.cached]
        self._freed = []
        return freed

    def _release(self, identifier: str, request_id: str) -> None:
        refs: Optional[set[str]] = self.cached.get(identifier)
        if refs is None:
            return
        refs.discard(request_id)
        if not refs:
            del self.cached[identifier]
            self._freed.append(identifier)


def image_blocks(features: list[MultiModalFeatureSpec]) -> list[tuple[int, int]]:
    """The prompt positions [lo, hi) of each run of image tokens (adjacent placeholder ranges make one run, as
    mlx-vlm's Gemma 4 block ids do)."""
    blocks: list[list[int]] = []
    for f in features:
        pos = f.mm_position
        if blocks and blocks[-1][1] == pos.offset:
            blocks[-1][1] = pos.end
        else:
            blocks.append([pos.offset, pos.end])
    return [(lo, hi) for lo, hi in blocks]


def whole_image_cut(features: list[MultiModalFeatureSpec], num_computed: int, num_new_tokens: int) -> int:
    """num_new_tokens cut so that the chunk does not end inside a run of image tokens."""
    end = num_computed + num_new_tokens
    for lo, hi in image_blocks(features):
        if lo < end < hi:
            return max(0, lo - num_computed)
    return num_new_tokens
