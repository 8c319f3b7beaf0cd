"""Chat images over HTTP: every bad image part is a 400 naming the part and the server goes on serving; a
text-only model refuses images; --allowed-local-media-path and --limit-mm-per-prompt."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image
from server_utils import MODEL, Served, error_of, make_engine

from pagedmlx.server.chat_media import MediaOptions, parse_limit_mm_per_prompt
from pagedmlx.server.serving import ServerLimits

MIB = 1 << 20


def png_bytes(size=(24, 20), color=(200, 30, 60)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat(*parts, text: str = "What is in the picture?", max_tokens: int = 4) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


class RecordingProcessor:
    """Stands in for the model's MultiModalProcessor: records what the server gives it."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def process_chat(self, messages, add_generation_prompt=True, chat_template_kwargs=None, tools=None):
        self.calls.append(messages)
        text = " ".join(p["text"] for m in messages for p in m["content"] if p["type"] == "text")
        return self.tokenizer.encode(text), []


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "cat.png").write_bytes(png_bytes())
    (root / "outside.png").write_bytes(png_bytes())
    return root


@pytest.fixture(scope="module")
def vision(media_dir):
    engine = make_engine()
    processor = RecordingProcessor(engine.tokenizer)
    s = Served(engine, limits=ServerLimits(max_body_bytes=4 * MIB, max_n=4), mm_processor=processor,
               media=MediaOptions(media_dir / "allowed", parse_limit_mm_per_prompt('{"image": 2}')))
    s.processor = processor
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
    from pagedmlx.multimodal.media import MediaConnector

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
    r = vision.client().chat.completions.create(model=MODEL, max_tokens=3,
                                               messages=[{"role": "user", "content": "still there?"}])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


@pytest.mark.parametrize("part", [image_part(data_url(png_bytes())), {"type": "image_url", "image_url": "data:,"},
                                  {"type": "input_image", "image_url": "data:,"}])
def test_a_text_only_model_refuses_images(text_only, part):
    r = httpx.post(text_only.url + "/v1/chat/completions", json=chat(part))
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == PART1 and "takes no images" in err["message"], err


def test_limit_mm_per_prompt_parses_as_vllm():
    assert parse_limit_mm_per_prompt('{"image": 4}') == {"image": 4}
    assert parse_limit_mm_per_prompt("{}") == {"image": 8}
    for bad, words in [('{"video": 1}', "modalities served are image"), ('{"image": -1}', ">= 0"),
                       ("[1]", "JSON object"), ("image=4", "JSON")]:
        with pytest.raises(ValueError, match=words):
            parse_limit_mm_per_prompt(bad)
