"""Images in the paged batch on tiny random-weight Gemma 3 and Gemma 4 models (mlx-vlm's classes): every request's
greedy tokens equal mlx-vlm's own generation for it alone, whatever shares its steps (issue 51)."""

from __future__ import annotations

import base64
import dataclasses
import io

import msgspec
import pytest

from mm_utils import FAMILIES, Family, family_reference, gemma3_processor, gemma3_vlm, image, run_arriving
from utils import greedy_mismatch, run_to_completion

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.engine.messages import AddRequest, decode, encode
from pagedmlx.multimodal import split_vlm, vlm_processor
from pagedmlx.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(params=list(FAMILIES))
def family(request) -> Family:
    return FAMILIES[request.param]


def make_engine(family: Family = FAMILIES["gemma3"], **config):
    vlm = family.vlm()
    text, encoder = split_vlm(vlm)
    processor, tokenizer = vlm_processor(family.processor(), encoder)
    config = {"block_size": 4, "num_blocks": 96, "max_num_batched_tokens": 24, **config}
    return LLMEngine(text, tokenizer, EngineConfig(**config), mm_encoder=encoder), processor, vlm


def check(vlm, done, prompts, family: Family = FAMILIES["gemma3"]):
    for rid, (ids, features) in prompts.items():
        got = list(done[rid].token_ids)
        why = greedy_mismatch(got, ids, GREEDY.max_tokens, family_reference(family, vlm, features))
        assert why is None, f"{rid}: {why}"


def test_busy_equals_solo_with_images_text_chunks_and_preemption(family):
    """Requests with one or two images of several sizes, text-only ones beside them, staggered arrivals, chunks that
    split images (24-token budget; Gemma 3's images are 4 tokens, Gemma 4's up to 16), a pool small enough to
    preempt."""
    engine, processor, vlm = make_engine(family, num_blocks=40 if family.name == "gemma3" else 40, max_num_seqs=6)
    BOI = family.marker
    texts = [(f"Describe {BOI} now.", [image(1, (24, 20))]),
             (f"The quick brown fox {BOI} jumps {BOI} over", [image(2, (40, 16)), image(3, (9, 30))]),
             ("Hello, world! How are you today?", []),
             (f"{BOI} What is the capital of France?", [image(4, (16, 16))]),
             ("Paged attention keeps the KV cache in fixed-size blocks.", []),
             (f"Paris is {BOI}{BOI} the capital", [image(5, (33, 21)), image(1, (24, 20))]),
             (f"Hello {BOI} world", [image(6, (64, 48))])]
    prompts = {}
    for i, (text, images) in enumerate(texts):
        prompts[f"r{i}"] = processor.process(text, images)
    done = run_arriving(engine, prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    distinct = {f.identifier for _, features in prompts.values() for f in features}
    assert len(distinct) == 6  # r5's second image is r0's: the same pixels, the same identifier
    assert engine.runner.mm.num_encoded >= 6
    check(vlm, done, prompts, family)
    assert not engine.runner.mm.encoder_cache and not engine.scheduler.encoder_cache_manager.cached


def test_prefix_hit_shares_pages_of_the_same_image_only(family):
    """The same text and image again: a prefix hit past the image, the same tokens. The same text with another
    image: no page after the image's first block is shared, and the tokens differ."""
    engine, processor, vlm = make_engine(family)
    BOI = family.marker
    text = f"The quick brown fox jumps over {BOI} the lazy dog. What is it?"
    prompts = {"a": processor.process(text, [image(1)])}
    params = dataclasses.replace(GREEDY, logprobs=0)
    engine.add_request("a", prompts["a"][0], params, mm_features=prompts["a"][1])
    done = run_to_completion(engine)
    offset = prompts["a"][1][0].mm_position.offset
    prompts["b"] = processor.process(text, [image(1)])
    prompts["c"] = processor.process(text, [image(7)])
    assert prompts["b"][0] == prompts["c"][0]  # the same token ids: only the image tells them apart
    engine.add_request("b", prompts["b"][0], params, mm_features=prompts["b"][1])
    done.update(run_to_completion(engine))
    engine.add_request("c", prompts["c"][0], params, mm_features=prompts["c"][1])
    done.update(run_to_completion(engine))
    assert done["b"].num_cached_tokens >= prompts["b"][1][0].mm_position.end
    assert done["c"].num_cached_tokens <= offset
    check(vlm, done, prompts, family)
    assert list(done["a"].token_ids) == list(done["b"].token_ids)

    def first_logprobs(rid):  # the first token's, a step computed with the image in context
        return [lp.logprob for lp in done[rid].logprobs[:1]]
    assert first_logprobs("a") == pytest.approx(first_logprobs("b"), abs=1e-4)
    assert (list(done["a"].token_ids) != list(done["c"].token_ids)
            or first_logprobs("a") != pytest.approx(first_logprobs("c"), abs=1e-3))


def test_chat_with_a_data_url_image_equals_generate(family):
    from pagedmlx import LLM

    llm = LLM(family.vlm(), tokenizer=family.processor(), block_size=4, num_blocks=64, max_num_batched_tokens=16)
    buf = io.BytesIO()
    image(3, (30, 20)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": " what is this?"}]}]
    chat = llm.chat(messages, GREEDY)[0]
    ids, features = llm.mm_processor.process_chat(messages)
    assert list(chat.prompt_token_ids) == ids and len(features) == 1
    prompt = f"<|im_start|>user\nHello {family.marker} what is this?<|im_end|>\n<|im_start|>assistant\n"
    gen = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image(3, (30, 20))}}, GREEDY)[0]
    assert list(chat.outputs[0].token_ids) == list(gen.outputs[0].token_ids)
    assert greedy_mismatch(list(gen.outputs[0].token_ids), ids, GREEDY.max_tokens,
                           family_reference(family, family.vlm(), features)) is None


def test_features_cross_the_process_boundary():
    _, processor, _ = make_engine()
    ids, features = processor.process(f"Hello {FAMILIES['gemma3'].marker} world", [image(2)])
    add = AddRequest("x", [("x", ids, GREEDY)], mm_features=[features])
    frames = encode(("add", add))
    (kind, got) = decode(frames)
    assert kind == "add" and got.mm_features == [features]
    back = got.mm_features[0][0].data["pixel_values"]
    assert back.numpy().tobytes() == features[0].data["pixel_values"].numpy().tobytes()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(features[0]), type=type(features[0])) == features[0]


def test_bad_image_requests_are_refused_by_name():
    engine, processor, _ = make_engine()
    ids, features = processor.process(f"Hello {FAMILIES['gemma3'].marker} world", [image(2)])
    moved = [msgspec.structs.replace(features[0], mm_position=type(features[0].mm_position)(0, 4))]
    with pytest.raises(ValueError, match="not only the image token"):
        engine.add_request("bad", ids, GREEDY, mm_features=moved)
    text_only = LLMEngine(split_vlm(gemma3_vlm())[0], engine.tokenizer, EngineConfig(block_size=4, num_blocks=32))
    with pytest.raises(ValueError, match="takes no images"):
        text_only.add_request("t", ids, GREEDY, mm_features=features)
    from pagedmlx import LLM

    llm = LLM(split_vlm(gemma3_vlm())[0], engine.tokenizer, block_size=4, num_blocks=32)
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate({"prompt": "Hello", "multi_modal_data": {"image": image(2)}}, GREEDY)
    with pytest.raises(ValueError, match="takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image(2)}]}], GREEDY)
    mm_llm = LLM(gemma3_vlm(), tokenizer=gemma3_processor(), block_size=4, num_blocks=32)
    with pytest.raises(ValueError, match="'image' only"):
        mm_llm.generate({"prompt": "Hello", "multi_modal_data": {"video": [image(2)]}}, GREEDY)
    with pytest.raises(ValueError, match="as 'prompt'"):
        mm_llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image(2)}}, GREEDY)
    with pytest.raises(ValueError, match="processor refused the prompt with 1 images"):
        mm_llm.generate({"prompt": "Hello", "multi_modal_data": {"image": image(2)}}, GREEDY)
    assert not mm_llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="remote images"):
        processor.process_chat([{"role": "user", "content": [{"type": "image_url",
                                                               "image_url": {"url": "http://x/y.png"}}]}])
    with pytest.raises(ValueError, match="not an image"):
        processor.process_chat([{"role": "user", "content": [{"type": "image_url",
                                                               "image_url": {"url": "data:image/png;base64,AAAA"}}]}])


def test_an_mlx_vlm_folder_loads_text_on_pages_and_the_tower_from_mlx_vlm(tmp_path):
    """config.json with a vision_config and mlx-vlm's weight names: mlx-lm's class runs the text model (it drops
    the vision weights), mlx-vlm's gives the tower; the tokens equal the in-process model's."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mm_utils import GEMMA3_VLM
    from pagedmlx.engine.core import EngineCore
    from pagedmlx.multimodal.models import Gemma3Vision

    vlm = gemma3_vlm()
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(vlm.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_VLM))
    engine, processor, _ = make_engine()
    core = EngineCore.from_config(EngineConfig(model=str(tmp_path), block_size=4, num_blocks=96,
                                               max_num_batched_tokens=24), engine.tokenizer)
    assert isinstance(core.mm_encoder, Gemma3Vision) and core.runner.mm is not None
    ids, features = processor.process(f"Hello {FAMILIES['gemma3'].marker} world, what is", [image(5)])
    engine.add_request("a", ids, GREEDY, mm_features=features)
    core.add_request("a", ids, GREEDY, mm_features=features)
    want = list(run_to_completion(engine)["a"].token_ids)
    got = []
    while core.has_unfinished_requests():
        got += [t for out in core.step() for t in out.new_token_ids]
    assert got == want


def test_families_whose_images_need_more_are_served_text_only():
    """Gemma 4 with bidirectional attention other than over image tokens ("vision" is served:
    test_images_bidirectional.py): text requests run, image requests get the reason. Families without an adapter
    are refused by name."""
    import copy
    import types

    from mm_utils import GEMMA4_VLM, gemma4_processor
    from pagedmlx.multimodal.loader import RefusedVision, build_vlm
    from pagedmlx.multimodal.families import vision_encoder
    from pagedmlx.multimodal.models import UnsupportedMultiModalError

    cfg = copy.deepcopy(GEMMA4_VLM)
    cfg["text_config"]["use_bidirectional_attention"] = "all"
    text, encoder = split_vlm(build_vlm(cfg))
    assert isinstance(encoder, RefusedVision)
    processor, tokenizer = vlm_processor(gemma4_processor(), encoder)
    engine = LLMEngine(text, tokenizer, EngineConfig(block_size=4, num_blocks=64), mm_encoder=encoder)
    ids, features = processor.process(f"Hello {FAMILIES['gemma4'].marker} world", [image(2)])
    with pytest.raises(ValueError, match="bidirectional"):
        engine.add_request("img", ids, GREEDY, mm_features=features)
    from pagedmlx.engine.core_info import image_support

    assert image_support(engine.core) == (False, encoder.reason)
    engine.add_request("txt", processor.process("Hello world")[0], GREEDY)
    assert len(run_to_completion(engine)["txt"].token_ids) == GREEDY.max_tokens
    for model_type, why in (("llava", "not served"), ("mllama", "not served")):
        with pytest.raises(UnsupportedMultiModalError, match=why):
            vision_encoder(types.SimpleNamespace(config=types.SimpleNamespace(model_type=model_type)))


def test_the_block_inspector_marks_pages_of_image_tokens():
    from pagedmlx.blocks.snapshot import expand_ranges, kv_snapshot
    from pagedmlx.blocks.view import IMAGE_CELL, render

    engine, processor, _ = make_engine()
    marker = FAMILIES["gemma3"].marker
    ids, features = processor.process(f"The quick brown fox jumps over {marker} the lazy dog.", [image(1)])
    engine.add_request("img", ids, GREEDY, mm_features=features)
    engine.add_request("txt", processor.process("The quick brown fox jumps over the lazy dog.")[0], GREEDY)
    engine.step()
    snap = kv_snapshot(engine)
    rows = {r["id"]: r for r in snap["requests"]}
    table = engine.kv_cache_manager.get_block_ids("img")[0]
    pos = features[0].mm_position
    want = sorted({table[t // 4] for t in range(pos.offset, pos.end)})
    assert expand_ranges(rows["img"]["image_blocks"]) == want and rows["img"]["images"] == 1
    assert rows["txt"]["image_blocks"] == "" and sorted(expand_ranges(snap["image_blocks"])) == want
    run_to_completion(engine)
    snap = kv_snapshot(engine)
    assert sorted(expand_ranges(snap["image_blocks"])) == want  # cached under keys that name the image
    from rich.console import Console

    console = Console(record=True, width=100)
    console.print(render(snap))
    assert IMAGE_CELL in console.export_text()


@pytest.mark.parametrize("dropped", [False, True])
def test_a_prefix_hit_that_ends_inside_an_image_splices_the_image_tail(family, dropped):
    """A's first chunk ends inside its image past a block boundary, then A is aborted: B (the same prompt) hits
    A's cached blocks up to the middle of the image and splices only the image's tail rows (from A's embeddings,
    which the runner still holds: an image is dropped only once no scheduled request needs it; `dropped`: a text
    request's steps between have the runner drop them, and B encodes the image again)."""
    if family.name == "qwen3_5":
        pytest.skip("Gated DeltaNet layers resume only from a saved state, not from any block inside a prompt")
    marker = family.marker
    _, processor, _ = make_engine(family)
    for n in range(12):  # a prompt whose image starts one token into a block and spans the next
        text = f"The quick fox{'!' * n} {marker} jumps over the lazy dog."
        ids, features = processor.process(text, [image(4, (32, 32))])
        pos = features[0].mm_position
        if pos.offset % 4 == 1 and pos.length >= 4:
            break
    else:
        pytest.skip("no prompt puts the image one token into a block")
    cut = pos.offset + 3  # a block boundary, 2 or more image tokens in
    engine, _, vlm = make_engine(family, max_num_batched_tokens=cut)
    engine.add_request("a", ids, GREEDY, mm_features=features)
    engine.step()
    engine.abort_request(["a"])
    if dropped:
        engine.add_request("t", processor.process("Hello, world!")[0], GREEDY)
        run_to_completion(engine)
        assert not engine.runner.mm.encoder_cache
    engine.add_request("b", ids, GREEDY, mm_features=features)
    done = run_to_completion(engine)
    assert done["b"].num_cached_tokens == cut and pos.offset < cut < pos.end
    assert engine.runner.mm.num_encoded == 1 + dropped and not engine.runner.mm.encoder_cache
    check(vlm, done, {"b": (ids, features)}, family)


def test_a_failed_encode_fails_its_step_and_the_next_request_encodes_again(monkeypatch):
    engine, processor, vlm = make_engine()
    ids, features = processor.process(f"Hello {FAMILIES['gemma3'].marker} world, what is", [image(8)])
    encoder = engine.runner.mm.encoder
    real = encoder.encode_stacked

    def broken(*args):
        raise RuntimeError("tower broke")
    monkeypatch.setattr(encoder, "encode_stacked", broken)
    engine.add_request("a", ids, GREEDY, mm_features=features)
    done = run_to_completion(engine)
    assert done["a"].finish_reason == "error" and "tower broke" in done["a"].error
    assert not engine.runner.mm.encoder_cache and not engine.scheduler.encoder_cache_manager.cached
    monkeypatch.setattr(encoder, "encode_stacked", real)
    engine.add_request("b", ids, GREEDY, mm_features=features)
    done = run_to_completion(engine)
    check(vlm, done, {"b": (ids, features)})
