"""M-RoPE (Qwen-VL families): image tokens rotate by three positions (t, h, w), and every token after an image by
its index shifted by what the images before it saved (an image of L tokens on a t x h x w grid of merged patches
takes max(t, h, w) positions). mlx-vlm's get_rope_index is the reference.

The core annotates each image feature when its request is added (`annotate`): data["mrope"] (4, L) int32 holds the
image tokens' (t, h, w) offsets and, in row 3, the shift the image adds to later tokens. The scheduler then gives a
step's RoPE positions (`step_rope_positions`): SchedulerOutput.rope_positions for every row (the token's index plus
the shifts of the images before it), and mrope_rows / mrope_positions (3, K) for the rows of image tokens, which the
attention layers' rotary embedding takes (multimodal/qwen3_5.py)."""

from __future__ import annotations

from typing import Sequence

import msgspec
import numpy as np

from pagedmlx.multimodal.inputs import MultiModalFeatureSpec, TensorData

MROPE = "mrope"


def annotate(features: Sequence[MultiModalFeatureSpec], spatial_merge_size: int) -> list[MultiModalFeatureSpec]:
    """Each feature with data["mrope"] from its image_grid_thw (patches) and the model's spatial merge size."""
    out = []
    for i, f in enumerate(features):
        grid = f.data.get("image_grid_thw")
        if grid is None:
            raise ValueError(f"mm_features[{i}]: M-RoPE needs the image's image_grid_thw")
        t, h, w = (int(x) for x in grid.numpy().reshape(-1)[:3])
        h, w = h // spatial_merge_size, w // spatial_merge_size
        if t * h * w != f.mm_position.length:
            raise ValueError(f"mm_features[{i}]: a {t} x {h} x {w} grid of merged patches for "
                             f"{f.mm_position.length} placeholder tokens")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        table = np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1),
                          np.full(t * h * w, max(t, h, w) - t * h * w)]).astype(np.int32)
        out.append(msgspec.structs.replace(f, data={**f.data, MROPE: TensorData.from_array(table)}))
    return out


def uses_mrope(features: Sequence[MultiModalFeatureSpec]) -> bool:
    return bool(features) and MROPE in features[0].data


def step_rope_positions(positions: np.ndarray, query_start_loc: np.ndarray, req_features: list) -> tuple:
    """(rope_positions (T,), mrope_rows (K,), mrope_positions (3, K)) of a step: positions are the rows' token
    indices; req_features per scheduled request, its features (empty: no M-RoPE images)."""
    rope = positions.astype(np.int64).copy()
    rows, pos3 = [], []
    for i, features in enumerate(req_features):
        if not features:
            continue
        lo, hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
        p = positions[lo:hi]
        shift = np.zeros(hi - lo, np.int64)
        before = 0  # the shifts of the images before the current one
        for f in features:
            table = f.data[MROPE].numpy()
            start, end = f.mm_position.offset, f.mm_position.end
            inside = (p >= start) & (p < end)
            if inside.any():
                k = p[inside] - start
                rows.append(lo + np.flatnonzero(inside))
                pos3.append(table[:3, k] + (start + before))
            before += int(table[3, 0])
            shift[p >= end] = before
        rope[lo:hi] = p + shift
    if not rows:
        return rope.astype(np.int32), np.zeros(0, np.int32), np.zeros((3, 0), np.int32)
    return rope.astype(np.int32), np.concatenate(rows).astype(np.int32), np.concatenate(pos3, axis=1).astype(np.int32)
