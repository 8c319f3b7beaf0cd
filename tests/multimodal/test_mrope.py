"""M-RoPE for Qwen3.5 images (multimodal/mrope.py, multimodal/qwen3_5.py): the positions a step gives equal mlx-vlm's
get_rope_index, decode positions carry its rope delta, and the engine's first-token logprobs equal mlx-vlm's (plain
1-D positions are measurably off, so this test can fail)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mm_utils import FAMILIES, image, stacked_reference_inputs
from test_images import make_engine
from utils import run_to_completion

from pagedmlx.multimodal.mrope import step_rope_positions
from pagedmlx.sampling_params import SamplingParams

QWEN = FAMILIES["qwen3_5"]


def prompt(processor):
    return processor.process(f"Hello {QWEN.marker} world {QWEN.marker}, what is", [image(1, (24, 20)),
                                                                                 image(2, (30, 12))])


def test_step_positions_equal_mlx_vlms_rope_index():
    engine, processor, vlm = make_engine(QWEN)
    ids, features = prompt(processor)
    features = engine.core.mm_encoder.annotate(features)
    pixels, kwargs = stacked_reference_inputs(features)
    want, delta = vlm.language_model.get_rope_index(mx.array(ids)[None], kwargs["image_grid_thw"])
    want = np.array(want[:, 0])  # (3, P)
    n = len(ids) + 5  # the prompt, then 5 decode positions
    rope, rows, pos3 = step_rope_positions(np.arange(n), np.array([0, n]), [features])
    images = np.concatenate([np.arange(f.mm_position.offset, f.mm_position.end) for f in features])
    assert rows.tolist() == images.tolist() and (pos3 == want[:, images]).all()
    text = np.setdiff1d(np.arange(len(ids)), images)
    assert (rope[text] == want[0, text]).all() and (want[:, text] == want[0, text]).all()
    assert rope[len(ids):].tolist() == (np.arange(len(ids), n) + int(delta.item())).tolist() and delta.item() != 0


def test_first_token_logprobs_equal_mlx_vlms():
    engine, processor, vlm = make_engine(QWEN)
    ids, features = prompt(processor)
    pixels, kwargs = stacked_reference_inputs(features)
    embeddings = vlm.get_input_embeddings(mx.array(ids)[None], pixels, mask=mx.ones((1, len(ids))), **kwargs)
    logits = vlm.language_model(mx.array(ids)[None], inputs_embeds=embeddings.inputs_embeds,
                                position_ids=embeddings.position_ids).logits[0, -1]
    want = np.array(logits - mx.logsumexp(logits))
    engine.add_request("a", ids, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5), mm_features=features)
    top = run_to_completion(engine)["a"].logprobs[0].top
    assert max(abs(lp - want[t]) for t, lp in top) < 1e-4, (top, [want[t] for t, _ in top])
    plain = vlm.language_model(mx.array(ids)[None], inputs_embeds=vlm.get_input_embeddings(
        mx.array(ids)[None], pixels, mask=mx.ones((1, len(ids))), **kwargs).inputs_embeds,
        position_ids=mx.broadcast_to(mx.arange(len(ids))[None, None], (3, 1, len(ids)))).logits[0, -1]
    assert np.abs(np.array(plain - mx.logsumexp(plain)) - want).max() > 1e-2  # positions matter here
