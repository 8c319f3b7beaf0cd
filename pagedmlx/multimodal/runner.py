"""The runner's side of images: the encoder cache's arrays and the input embeddings of a step with image rows.

A step without images never comes here (ModelRunner checks SchedulerOutput.mm_features): text-only steps are
built exactly as before."""

from __future__ import annotations

import logging
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from pagedmlx.core.sched.output import SchedulerOutput
from pagedmlx.multimodal.encoder_cache import image_blocks
from pagedmlx.multimodal.models import VisionEncoder

logger = logging.getLogger("pagedmlx")


class MultiModalRunner:
    def __init__(self, encoder: VisionEncoder, body: nn.Module):
        """encoder: the family's vision path (multimodal/models.py); body: mlx-lm's text model body (the module
        with embed_tokens that takes input_embeddings)."""
        self.encoder, self.body = encoder, body
        self.encoder_cache: dict[str, mx.array] = {}  # identifier -> (length, hidden) rows to splice
        self.num_encoded = 0  # images run through the vision tower (tests and stats)

    def step_kwargs(self, so: SchedulerOutput, input_ids: mx.array) -> dict[str, Any]:
        """The text model's keyword arguments for a step with image rows: each image the step reaches is encoded
        once (unless cached), and its rows among the step's replace those tokens' embeddings."""
        rows, pieces = [], []
        starts = (so.seq_lens - np.asarray(so.num_scheduled_tokens)).tolist()
        index = {rid: i for i, rid in enumerate(so.req_ids)}
        dtype = self.body.embed_tokens.weight.dtype if hasattr(self.body.embed_tokens, "weight") else mx.float32
        if dtype not in (mx.float32, mx.float16, mx.bfloat16):  # quantized embedding: its scales' dtype
            dtype = self.body.embed_tokens.scales.dtype
        spans = []  # (feature, first step row, first and last + 1 of its placeholder tokens in the step)
        for rid, features in so.mm_features.items():
            i = index[rid]
            start, n, row0 = starts[i], so.num_scheduled_tokens[i], int(so.query_start_loc[i])
            for f in features:
                a, b = max(start, f.mm_position.offset), min(start + n, f.mm_position.end)
                if a < b:
                    spans.append((f, row0 + a - start, a, b))
        new = list({f.identifier: f for f, *_ in spans if f.identifier not in self.encoder_cache}.values())
        if new:  # the step's images not held yet, encoded together
            for f, embeds in zip(new, self.encoder.encode_batch(new, dtype)):
                if embeds.shape[0] != f.mm_position.length:
                    raise ValueError(f"image {f.identifier[:12]}: the encoder gives {embeds.shape[0]} rows for "
                                     f"{f.mm_position.length} placeholder tokens")
                self.encoder_cache[f.identifier] = embeds
            self.num_encoded += len(new)
        for f, row, a, b in spans:
            rows.append(np.arange(row, row + b - a))
            pieces.append(self.encoder_cache[f.identifier][a - f.mm_position.offset:b - f.mm_position.offset])
        for identifier in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(identifier, None)
        if not rows:
            return {}
        image_rows = mx.array(np.concatenate(rows).astype(np.int32))
        image_embeds = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)
        return self.encoder.input_embeddings(self.body, input_ids, image_rows, image_embeds)

    def image_spans(self, so: SchedulerOutput) -> Optional[np.ndarray]:
        """For a model whose image tokens attend each other both ways: (T, 2) the positions [lo, hi) of the image
        run each row's token lies in (lo == hi == 0 for other rows); the scheduler puts each run whole in one step.
        None otherwise."""
        if not self.encoder.bidirectional or not so.mm_features:
            return None
        spans = np.zeros((so.total_num_scheduled_tokens, 2), np.int32)
        index = {rid: i for i, rid in enumerate(so.req_ids)}
        for rid, features in so.mm_features.items():
            i = index[rid]
            start = int(so.seq_lens[i]) - so.num_scheduled_tokens[i]
            row0 = int(so.query_start_loc[i]) - start  # the row of position p is row0 + p
            for lo, hi in image_blocks(features):
                if lo < start or hi > start + so.num_scheduled_tokens[i]:
                    raise RuntimeError(f"request {rid}: image tokens [{lo}, {hi}) split across steps")
                spans[row0 + lo:row0 + hi] = (lo, hi)
        return spans

    def forward_context(self, so: SchedulerOutput):
        """The family's context around the text model's call on a step with image rows."""
        return self.encoder.forward_context(self.body, so)
