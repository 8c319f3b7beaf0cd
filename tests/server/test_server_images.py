"""Chat images over HTTP, on a tiny random-weight Gemma 3 served in-process: every bad image part is a 400 naming
the part and the server goes on serving; a text-only model refuses images; --allowed-local-media-path and
--limit-mm-per-prompt; an OpenAI SDK chat with base64 images gives the offline engine's tokens exactly."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mm_utils import GEMMA3_VLM, data_url, encode, gemma3_processor, gemma3_vlm, image
from PIL import Image
from server_utils import MODEL, Served, error_of, free_port, make_engine
from utils import run_to_completion

from pagedmlx.config import EngineConfig
from pagedmlx.engine.core_info import CoreInfo
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.multimodal import split_vlm, vlm_processor
from pagedmlx.multimodal.media import MediaConnector
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.server.chat_media import MediaOptions, images_refused, parse_limit_mm_per_prompt
from pagedmlx.server.serving import ServerLimits

MIB = 1 << 20
CONFIG = dict(block_size=4, num_blocks=128, max_num_batched_tokens=24)


def png_bytes(size=(24, 20), color=(200, 30, 60)) -> bytes:
    return encode(Image.new("RGB", size, color))


def chat(*parts, text: str = "What is in the picture?", max_tokens: int = 4) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


class RecordingProcessor:
    """The model's MultiModalProcessor, recording the messages the server gives it."""

    def __init__(self, processor):
        self.processor, self.calls = processor, []

    def process_chat(self, messages, **kwargs):
        self.calls.append(messages)
        return self.processor.process_chat(messages, **kwargs)


def vision_engine() -> tuple[LLMEngine, object]:
    """A tiny random-weight Gemma 3 engine and its MultiModalProcessor."""
    text, encoder = split_vlm(gemma3_vlm())
    processor, tokenizer = vlm_processor(gemma3_processor(), encoder)
    return LLMEngine(text, tokenizer, EngineConfig(**CONFIG), mm_encoder=encoder), processor


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "cat.png").write_bytes(png_bytes())
    (root / "outside.png").write_bytes(png_bytes())
    return root


@pytest.fixture(scope="module")
def vision(media_dir):
    engine, processor = vision_engine()
    recording = RecordingProcessor(processor)
    s = Served(engine, limits=ServerLimits(max_body_bytes=4 * MIB, max_n=4), mm_processor=recording,
               media=MediaOptions(media_dir / "allowed", parse_limit_mm_per_prompt('{"image": 2}')))
    s.processor = recording
    yield s
    s.stop()


@pytest.fixture(scope="module")
def text_only():
    s = Served(make_engine())
    yield s
    s.stop()


def _bomb() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (9000, 9000)).save(buf, "PNG")  # 81 Mpx in a few kB
    return buf.getvalue()


PART1 = "messages[0].content[1]"
BAD = {
    "truncated png": ([image_part(data_url(png_bytes()[:-30]))], PART1 + ".image_url", "truncated or corrupt"),
    "text as an image": ([image_part(data_url(b"just some text, no pixels"))], PART1 + ".image_url", "not an image"),
    "a text data URL": ([image_part("data:text/plain;base64,aGVsbG8=")], PART1 + ".image_url", "must hold an image"),
    "oversized": ([image_part(data_url(_bomb()))], PART1 + ".image_url", "9000 x 9000 pixels, over the limit"),
    "remote URL": ([image_part("https://example.com/cat.png")], PART1 + ".image_url", "remote images"),
    "file outside the allowed folder": ([image_part("file://{root}/allowed/../outside.png")], PART1 + ".image_url",
                                        "must be under the folder the server allows"),
    "too many images": ([image_part(data_url(png_bytes()))] * 3, "messages[0].content[3]",
                        "at most 2 images may be sent in one request (--limit-mm-per-prompt), got 3"),
    "an audio part": ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}], PART1,
                      "type 'input_audio' are not supported"),
    "image_url not a URL": ([{"type": "image_url", "image_url": 5}], "messages", PART1 + ".image_url: image_url must "
                            "be an object with a url, or a URL string"),
    "a bad detail": ([{"type": "image_url", "image_url": {"url": "data:,", "detail": "max"}}], "messages",
                     PART1 + ".image_url.detail"),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_image_parts_are_400_naming_the_part(vision, media_dir, case, stream):
    parts, param, words = BAD[case]
    parts = [{**p, "image_url": {**p["image_url"], "url": p["image_url"]["url"].format(root=media_dir)}}
             if isinstance(p.get("image_url"), dict) and "url" in p["image_url"] else p for p in parts]
    r = httpx.post(vision.url + "/v1/chat/completions", json={**chat(*parts), "stream": stream}, timeout=30)
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == param and words in err["message"], err
    assert httpx.get(vision.url + "/health").status_code == 200


def test_a_file_url_without_the_flag_is_refused(vision, media_dir, monkeypatch):
    monkeypatch.setattr(vision.app.state.serving.chat_prompts, "connector", MediaConnector())
    r = httpx.post(vision.url + "/v1/chat/completions", json=chat(image_part(f"file://{media_dir}/allowed/cat.png")))
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == PART1 + ".image_url", err
    assert "--allowed-local-media-path" in err["message"]


def test_good_images_reach_the_processor_in_order(vision, media_dir):
    """data: URLs, the string form, `input_image` and an allowed file, decoded to RGB, between the texts."""
    vision.processor.calls.clear()
    body = chat(image_part(data_url(png_bytes(color=(1, 2, 3)))),
                {"type": "input_image", "image_url": f"file://{media_dir}/allowed/cat.png"}, text="two pictures")
    r = httpx.post(vision.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    (messages,) = vision.processor.calls
    parts = messages[0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_pil", "image_pil"]
    assert parts[1]["image_pil"].mode == "RGB" and parts[1]["image_pil"].getpixel((0, 0)) == (1, 2, 3)
    assert parts[2]["image_pil"].getpixel((0, 0)) == (200, 30, 60)


def test_the_server_keeps_serving_after_bad_payloads(vision):
    for case in ("truncated png", "text as an image", "too many images"):
        assert httpx.post(vision.url + "/v1/chat/completions", json=chat(*BAD[case][0])).status_code == 400
    for content in ("still there?", [{"type": "text", "text": "and with "}, image_part(data_url(png_bytes()))]):
        r = vision.client().chat.completions.create(model=MODEL, max_tokens=3, temperature=0,
                                                   messages=[{"role": "user", "content": content}])
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


@pytest.mark.parametrize("part", [image_part(data_url(png_bytes())), {"type": "image_url", "image_url": "data:,"},
                                  {"type": "input_image", "image_url": "data:,"}])
def test_a_text_only_model_refuses_images(text_only, part):
    r = httpx.post(text_only.url + "/v1/chat/completions", json=chat(part))
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == PART1 and "takes no images (it is a text-only model)" \
        in err["message"], err


def test_limit_mm_per_prompt_parses_as_vllm():
    assert parse_limit_mm_per_prompt('{"image": 4}') == {"image": 4}
    assert parse_limit_mm_per_prompt("{}") == {"image": 8}
    assert parse_limit_mm_per_prompt('{"image": {"count": 3, "width": 512, "height": 512}}') == {"image": 3}
    for bad, words in [('{"video": 1}', "modalities served are image"), ('{"image": -1}', ">= 0"),
                       ('{"image": {"width": 5}}', ">= 0"), ("[1]", "JSON object"), ("image=4", "JSON")]:
        with pytest.raises(ValueError, match=words):
            parse_limit_mm_per_prompt(bad)


IMAGES = {"one image": [(3, (30, 20))], "another image": [(4, (16, 40))], "two images": [(4, (16, 40)), (3, (30, 20))]}


def _contents(images: list) -> tuple[list[dict], list[dict]]:
    """One user message with these images between texts: as the client sends it (base64 PNGs) and as the offline
    engine's processor takes it (the PIL images themselves)."""
    sent, offline = [{"type": "text", "text": "Hello "}], [{"type": "text", "text": "Hello "}]
    for seed, size in images:
        sent.append(image_part(data_url(encode(image(seed, size)))))
        offline.append({"type": "image_pil", "image_pil": image(seed, size)})
    tail = {"type": "text", "text": " what is this?"}
    return sent + [tail], offline + [tail]


@pytest.mark.parametrize("stream", [False, True])
def test_an_openai_sdk_chat_with_base64_images_gives_the_offline_tokens(vision, stream):
    """The served prompt ids and greedy tokens equal an offline engine's for the same images and text, exactly."""
    engine, processor = vision_engine()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    client, prompts, got = vision.client(), {}, {}
    for name, images in IMAGES.items():
        sent, offline = _contents(images)
        prompts[name], features = processor.process_chat([{"role": "user", "content": offline}])
        engine.add_request(name, prompts[name], params, mm_features=features)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": sent}], max_tokens=8, temperature=0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            got[name] = [t for c in chunks if c.choices for t in getattr(c.choices[0], "token_ids", None) or []]
        else:
            r = client.chat.completions.create(**kw)
            got[name] = r.choices[0].token_ids
            assert r.prompt_token_ids == prompts[name] and r.usage.prompt_tokens == len(prompts[name])
    want = {rid: list(out.token_ids) for rid, out in run_to_completion(engine).items()}
    assert got == want
    assert len({tuple(t) for t in got.values()}) == len(IMAGES), "different images, different tokens"


def test_images_decode_off_the_event_loop(vision, monkeypatch):
    """Four requests with a 900 x 900 noise PNG each (2.4 MB) at once: decoded in the tokenizing pool, while /health
    goes on answering."""
    threads, decode = set(), MediaConnector.decode_image

    def recording(self, data, param="image"):
        threads.add(threading.current_thread().name)
        return decode(self, data, param)

    monkeypatch.setattr(MediaConnector, "decode_image", recording)
    noise = np.random.default_rng(0).integers(0, 256, (900, 900, 3), dtype=np.uint8)
    body = chat(image_part(data_url(encode(Image.fromarray(noise)))), max_tokens=1)
    slowest = 0.0

    async def main() -> list[int]:
        nonlocal slowest
        stop = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as client:
            async def poll():
                nonlocal slowest
                while not stop.is_set():
                    t = time.monotonic()
                    assert (await client.get(vision.url + "/health")).status_code == 200
                    slowest = max(slowest, time.monotonic() - t)
                    await asyncio.sleep(0.02)

            poller = asyncio.create_task(poll())
            responses = await asyncio.gather(*(client.post(vision.url + "/v1/chat/completions", json=body)
                                               for _ in range(4)))
            stop.set()
            await poller
        return [r.status_code for r in responses]

    assert asyncio.run(main()) == [200] * 4
    assert threads and all(name.startswith("pagedmlx-tokenize") for name in threads), threads
    assert slowest < 1.0, slowest


def test_refusals_say_why():
    def info(takes: bool, refused: str = "") -> CoreInfo:
        return CoreInfo(256, 512, {}, None, None, 1, "", takes_images=takes, images_refused=refused)

    processor = object()
    assert images_refused(processor, info(True)) is None
    assert images_refused(None, info(False)) == "it is a text-only model"
    assert images_refused(None, info(False, "Qwen3.5's M-RoPE")) == "Qwen3.5's M-RoPE"
    assert images_refused(None, info(True)) == "the server could not load the model's image processor"


def test_n_samples_carry_the_images(vision):
    r = vision.client().chat.completions.create(
        model=MODEL, n=2, max_tokens=4, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True},
        messages=[{"role": "user", "content": _contents(IMAGES["one image"])[0]}])
    solo = vision.client().chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True},
        messages=[{"role": "user", "content": _contents(IMAGES["one image"])[0]}])
    assert [c.token_ids for c in r.choices] == [solo.choices[0].token_ids] * 2


def save_gemma3_folder(folder) -> None:
    """The tiny Gemma 3 as an mlx-vlm checkpoint folder: weights, config and its processor's files."""
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(gemma3_vlm().parameters())))
    (folder / "config.json").write_text(json.dumps(GEMMA3_VLM))
    gemma3_processor().save_pretrained(str(folder))
    # Gemma3Processor reads its image tokens as named tokenizer attributes (a real Gemma checkpoint names them so)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = dict(zip(("boi_token", "eoi_token", "image_token"),
                                              config["extra_special_tokens"]))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.slow
def test_pagedmlx_serve_takes_images(tmp_path, media_dir):
    """`pagedmlx serve` on an mlx-vlm folder: the API process loads the processor, the flags apply, the features
    cross to the engine-core process, and the same image twice shares its pages."""
    save_gemma3_folder(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pagedmlx.cli", "serve", str(tmp_path), "--port", str(port),
                             "--block-size", "4", "--num-blocks", "128", "--max-model-len", "256",
                             "--served-model-name", MODEL, "--allowed-local-media-path", str(media_dir / "allowed"),
                             "--limit-mm-per-prompt", '{"image": 1}'], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        cat = image_part(f"file://{media_dir}/allowed/cat.png")
        usage = [httpx.post(url + "/v1/chat/completions", json=chat(cat, max_tokens=2), timeout=60).json()["usage"]
                 for _ in range(2)]
        assert usage[0]["prompt_tokens"] == usage[1]["prompt_tokens"] > usage[1]["prompt_tokens_details"][
            "cached_tokens"] > usage[0]["prompt_tokens_details"]["cached_tokens"]
        r = httpx.post(url + "/v1/chat/completions", json=chat(cat, cat), timeout=60)
        assert r.status_code == 400 and "at most 1 image may be sent" in error_of(r)["message"]
    finally:
        proc.send_signal(2)
        _, err = proc.communicate(timeout=60)
    allowed = os.path.realpath(media_dir / "allowed")
    assert f"images: at most 1 a request; data: URLs, file:// under {allowed}; request bodies up to 33554432 " \
           f"bytes" in err, err
