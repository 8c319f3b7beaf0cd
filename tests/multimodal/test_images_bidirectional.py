"""Gemma 4 with text_config.use_bidirectional_attention="vision": an image's tokens attend each other both ways. Every
request's greedy tokens equal mlx-vlm's own generation (given the processor's mm_token_type_ids, as mlx-vlm's generate
passes them), with images scheduled whole, text-only requests beside, a preemption and a prefix hit; the causal-only
path gives other tokens (the negative control)."""

from __future__ import annotations

import copy
import functools

import mlx.core as mx
import numpy as np
import pytest

from mm_utils import FAMILIES, GEMMA4_VLM, gemma4_processor, image, pixels_of, run_arriving, vlm_greedy
from utils import greedy_mismatch, run_to_completion

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.multimodal import split_vlm, vlm_processor
from pagedmlx.multimodal.loader import build_vlm
from pagedmlx.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
MARKER = FAMILIES["gemma4"].marker
IMAGE_ID = GEMMA4_VLM["image_token_id"]


@functools.lru_cache(maxsize=None)
def bidi_vlm(seed: int = 0):
    cfg = copy.deepcopy(GEMMA4_VLM)
    cfg["text_config"]["use_bidirectional_attention"] = "vision"
    return build_vlm(cfg, seed)


def make_engine(**config):
    vlm = bidi_vlm()
    text, encoder = split_vlm(vlm)
    assert encoder.bidirectional
    processor, tokenizer = vlm_processor(gemma4_processor(), encoder)
    config = {"block_size": 4, "num_blocks": 96, "max_num_batched_tokens": 24, **config}
    return LLMEngine(text, tokenizer, EngineConfig(**config), mm_encoder=encoder), processor, vlm


def reference(vlm, features, bidirectional: bool = True):
    """mlx-vlm's greedy continuation; with mm_token_type_ids (image tokens 1) its Gemma 4 attends images both ways."""
    def run(prompt, max_tokens):
        kwargs = {}
        if bidirectional and features:
            kwargs["mm_token_type_ids"] = mx.array((np.array(prompt) == IMAGE_ID).astype(np.int32)[None])
        return vlm_greedy(vlm, prompt, pixels_of(features), max_tokens, **kwargs)
    return run


def mismatches(vlm, done, prompts, bidirectional: bool = True) -> dict:
    out = {}
    for rid, (ids, features) in prompts.items():
        why = greedy_mismatch(list(done[rid].token_ids), ids, GREEDY.max_tokens,
                              reference(vlm, features, bidirectional))
        if why is not None:
            out[rid] = why
    return out


TEXTS = [(f"Describe {MARKER} now.", [image(1, (24, 20))]),
         (f"The quick brown fox {MARKER} jumps {MARKER} over", [image(2, (40, 16)), image(3, (9, 30))]),
         ("Hello, world! How are you today?", []),
         (f"{MARKER} What is the capital of France?", [image(4, (16, 16))]),
         ("Paged attention keeps the KV cache in fixed-size blocks.", []),
         (f"Paris is {MARKER} the capital", [image(5, (33, 21))]),
         (f"Hello {MARKER} world", [image(6, (64, 48))])]


def run_busy(engine, processor):
    prompts = {f"r{i}": processor.process(text, images) for i, (text, images) in enumerate(TEXTS)}
    return prompts, run_arriving(engine, prompts, GREEDY)


@pytest.mark.parametrize("cap", [0, 5])
def test_busy_images_whole_text_beside_and_preemption_equal_mlx_vlm(monkeypatch, cap):
    """cap: long_prefill_token_threshold, which chunks a prompt while others decode; an image longer than it still
    goes whole (past the cap, within the step's budget), never waiting for the decodes to end."""
    engine, processor, vlm = make_engine(num_blocks=40, max_num_seqs=6, long_prefill_token_threshold=cap)
    sched = engine.scheduler
    assert sched.encoder_cache_manager.whole_images
    real = sched.schedule
    steps = []

    def schedule():
        so = real()
        steps.append({rid: (int(so.seq_lens[i]) - so.num_scheduled_tokens[i], int(so.seq_lens[i]))
                      for i, rid in enumerate(so.req_ids)})
        return so
    monkeypatch.setattr(sched, "schedule", schedule)
    prompts, done = run_busy(engine, processor)
    assert sched.num_preemptions > 0
    longest = {rid: max((f.mm_position.length for f in features), default=0) for rid, (_, features) in prompts.items()}
    if cap:  # some image went past the cap while another request decoded
        assert any(end - start > cap and any(e - s == 1 for r, (s, e) in step.items() if r != rid)
                   for step in steps for rid, (start, end) in step.items() if longest[rid] > cap)
    for step in steps:  # no chunk ends inside an image
        for rid, (start, end) in step.items():
            for f in prompts[rid][1]:
                assert not (f.mm_position.offset < end < f.mm_position.end), (rid, start, end)
                assert not (f.mm_position.offset < start < f.mm_position.end), (rid, start, end)
    assert mismatches(vlm, done, prompts) == {}
    assert not engine.runner.mm.encoder_cache and not sched.encoder_cache_manager.cached


def test_causal_only_path_gives_other_tokens(monkeypatch):
    """The negative control: mlx-vlm without the overlay differs from with it on these prompts, and so does the
    engine with its image spans switched off (causal attention over image tokens)."""
    vlm = bidi_vlm()
    engine, processor, _ = make_engine(num_blocks=40, max_num_seqs=6)
    prompts = {f"r{i}": processor.process(text, images) for i, (text, images) in enumerate(TEXTS)}
    differs = [rid for rid, (ids, features) in prompts.items() if features and
               reference(vlm, features)(ids, GREEDY.max_tokens).tokens
               != reference(vlm, features, False)(ids, GREEDY.max_tokens).tokens]
    assert differs  # the overlay matters for these weights
    monkeypatch.setattr(engine.runner.mm, "image_spans", lambda so: None)
    _, done = run_busy(engine, processor)
    bad = mismatches(vlm, done, prompts)
    assert set(differs) <= set(bad)


def test_a_prefix_hit_that_would_end_inside_an_image_is_cut_back_before_it():
    """A prompt that ends with its image: run again, its longest hit (never the last token) ends inside the image,
    and is cut back to the block where the image starts; the image is computed whole again, the tokens exact. With
    text after the image the hit runs past it, kept."""
    engine, processor, vlm = make_engine()
    for n in range(12):
        ids, features = processor.process(f"The quick fox{'!' * n} {MARKER}", [image(4, (32, 32))])
        pos = features[0].mm_position
        hit = (len(ids) - 1) // 4 * 4
        if pos.offset % 4 and pos.offset < hit < pos.end:
            break
    else:
        pytest.skip("no prompt whose longest hit ends inside its image")
    engine.add_request("a", ids, GREEDY, mm_features=features)
    done = run_to_completion(engine)
    engine.add_request("b", ids, GREEDY, mm_features=features)
    done.update(run_to_completion(engine))
    assert done["b"].num_cached_tokens == pos.offset // 4 * 4
    more = processor.process(f"The quick fox{'!' * n} {MARKER} jumps over the lazy dog.", [image(4, (32, 32))])
    engine.add_request("c", *more[:1], GREEDY, mm_features=more[1])
    engine.add_request("d", *more[:1], GREEDY, mm_features=more[1])
    done.update(run_to_completion(engine))
    assert done["d"].num_cached_tokens >= more[1][0].mm_position.end
    prompts = {"a": (ids, features), "b": (ids, features), "c": more, "d": more}
    assert mismatches(vlm, done, prompts) == {}
    assert list(done["a"].token_ids) == list(done["b"].token_ids)


def test_an_image_larger_than_a_step_is_refused():
    engine, processor, _ = make_engine(max_num_batched_tokens=8)
    ids, features = processor.process(f"Hello {MARKER} world", [image(6, (64, 48))])
    assert features[0].mm_position.length > 8
    with pytest.raises(ValueError, match="one step"):
        engine.add_request("a", ids, GREEDY, mm_features=features)


def test_a_step_with_image_rows_takes_explicit_masks_never_the_kernels():
    """Metadata only (the kernels' host side is built on any backend): a decode beside a 9-token prompt whose
    positions 2..6 are one image. With the decode kernel and the prefill kernel planned, and a window of 4: the
    prompt stays one prefill segment (no decode rows, no tiles) under causal (and window) OR the same image; without
    image spans the same step takes the kernels."""
    from pagedmlx.core.sched.output import build_scheduler_output
    from pagedmlx.request import Request
    from pagedmlx.runner.attention_metadata import StepMetadata

    reqs = [Request("d", [5, 6, 7], SamplingParams(max_tokens=4)), Request("p", list(range(1, 10)), SamplingParams())]
    reqs[0].num_computed_tokens = 3
    blocks = {"d": ([3], [3]), "p": ([0, 1, 2], [0, 1, 2])}
    so = build_scheduler_output([(reqs[0], 1), (reqs[1], 9)], blocks.__getitem__, 4, [], set())
    spans = np.zeros((10, 2), np.int32)
    spans[1 + 2:1 + 7] = (2, 7)
    heads = dict(kernel_kv_heads=[1, 1], prefill_heads=[(1, 2), (1, 2)])
    plain = StepMetadata.build(so, 4, [None, 4], **heads).groups
    assert all(g.prefill_tiles is not None or g.num_decodes == 10 for g in plain)
    for window, md in zip([None, 4], StepMetadata.build(so, 4, [None, 4], **heads, image_spans=spans).groups):
        assert md.num_decodes == 1 and md.prefill_tiles is None
        (g,) = md.prefill_groups
        causal = [[k <= j and (window is None or k > j - window) for k in range(g.num_keys)] for j in range(9)]
        want = [[c or (2 <= j < 7 and 2 <= k < 7) for k, c in enumerate(row)] for j, row in enumerate(causal)]
        assert g.mask.tolist() == [[want]]
