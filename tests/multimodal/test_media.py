"""multimodal/media.py: every payload that gives no usable image is a MediaError naming its part, and
nothing outside --allowed-local-media-path is read."""

from __future__ import annotations

import os
import time

import pytest
from mm_utils import data_url, encode
from PIL import Image

from pagedmlx.multimodal.media import MediaConnector, MediaError

PART = "messages[0].content[1].image_url"


def png(width: int = 24, height: int = 16, mode: str = "RGB", color=(200, 30, 60)) -> bytes:
    return encode(Image.new(mode, (width, height), color))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_formats_decode_to_rgb(fmt):
    image = MediaConnector().fetch_image(data_url(encode(Image.new("RGB", (24, 16), (200, 30, 60)), fmt)), PART)
    assert image.mode == "RGB" and image.size == (24, 16)
    if fmt in ("PNG", "BMP", "TIFF"):  # lossless
        assert image.getpixel((3, 3)) == (200, 30, 60)


def test_transparency_goes_over_white():
    image = MediaConnector().fetch_image(data_url(png(mode="RGBA", color=(0, 0, 0, 0))), PART)
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 255, 255)


def test_the_data_url_string_form_is_read_whatever_the_declared_image_type():
    """Clients label a JPEG image/png now and then: the bytes decide, as in vLLM."""
    jpeg = encode(Image.new("RGB", (8, 8)), "JPEG")
    assert MediaConnector().fetch_image(data_url(jpeg, "image/png"), PART).size == (8, 8)


BAD_PAYLOADS = {
    "truncated png": (data_url(png()[:-30]), "truncated or corrupt"),
    "half a png": (data_url(png(64, 64)[:60]), "truncated or corrupt"),
    "truncated jpeg": (data_url(encode(Image.effect_noise((64, 64), 50).convert("RGB"), "JPEG")[:-200]),
                       "truncated or corrupt"),
    "text as an image": (data_url(b"hello, I am not a picture at all"), "not an image"),
    "empty": ("data:image/png;base64,", "empty"),
    "not base64": ("data:image/png,rawbytes", "base64"),
    "a text media type": ("data:text/plain;base64,aGVsbG8=", "must hold an image"),
    "an svg": (data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"), "not an image"),
    "an eps (Pillow would run Ghostscript)": (data_url(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 1 1\n",
                                                       "image/eps"), "not an image"),
    "bad padding": ("data:image/png;base64,abc", "base64"),
    "remote http": ("http://example.com/cat.png", "remote images"),
    "remote https": ("https://example.com/cat.png", "remote images"),
    "another scheme": ("ftp://example.com/cat.png", "data URL"),
    "no scheme": ("cat.png", "data URL"),
    "a local file without the flag": ("file:///etc/hostname", "--allowed-local-media-path"),
}


@pytest.mark.parametrize("case", list(BAD_PAYLOADS))
def test_bad_payloads_name_the_part(case):
    url, words = BAD_PAYLOADS[case]
    with pytest.raises(MediaError, match=words) as err:
        MediaConnector().fetch_image(url, PART)
    assert err.value.param == PART and str(err.value).startswith(PART)


def test_oversized_images_are_refused_before_decoding():
    connector = MediaConnector(max_image_bytes=1000, max_image_pixels=64 * 64)
    with pytest.raises(MediaError, match="larger than 1000 bytes"):
        connector.fetch_image(data_url(encode(Image.effect_noise((64, 64), 50), "PNG")), PART)
    with pytest.raises(MediaError, match="65 x 64 pixels, over the limit of 4096 pixels"):
        connector.fetch_image(data_url(png(65, 64)), PART)
    assert connector.fetch_image(data_url(png(64, 64)), PART).size == (64, 64)


def test_a_decompression_bomb_is_refused_unread():
    """A 9000 x 9000 PNG of one colour compresses to 100 kB; decoded as RGB it would take 243 MB."""
    bomb = encode(Image.new("1", (9000, 9000)), "PNG")
    t = time.monotonic()
    with pytest.raises(MediaError, match="9000 x 9000 pixels, over the limit of 67108864 pixels"):
        MediaConnector().fetch_image(data_url(bomb), PART)
    assert time.monotonic() - t < 0.5
    # Over twice Pillow's own limit, Pillow refuses it as it opens it
    with pytest.raises(MediaError, match="over the limit of 67108864 pixels"):
        MediaConnector().fetch_image(data_url(encode(Image.new("1", (14_000, 14_000)), "PNG")), PART)


@pytest.fixture
def media_dir(tmp_path):
    allowed = tmp_path / "media"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "cat.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png())
    (allowed / "escape.png").symlink_to(tmp_path / "secret.png")
    (allowed / "text.png").write_bytes(b"plain text")
    os.mkfifo(allowed / "pipe.png")
    return allowed


def test_local_files_under_the_allowed_folder(media_dir):
    connector = MediaConnector(media_dir)
    assert connector.fetch_image(f"file://{media_dir}/sub/cat.png", PART).size == (24, 16)
    assert connector.fetch_image(f"file://localhost{media_dir}/sub/../sub/cat.png", PART).size == (24, 16)
    assert connector.fetch_image(f"file://{media_dir}/sub/cat%2Epng", PART).size == (24, 16)  # percent-encoded


@pytest.mark.parametrize("path, words", [
    ("{root}/../secret.png", "must be under the folder the server allows"),
    ("{root}/sub/../../secret.png", "must be under the folder the server allows"),
    ("{root}/%2E%2E/secret.png", "must be under the folder the server allows"),
    ("{root}/escape.png", "must be under the folder the server allows"),  # a symlink out of the folder
    ("/etc/passwd", "must be under the folder the server allows"),
    ("{root}/missing.png", "cannot read the file"),
    ("{root}/sub", "not a regular file"),
    ("{root}/pipe.png", "not a regular file"),  # a FIFO: opening it must not wait for a writer
    ("{root}/text.png", "not an image"),
])
def test_local_files_outside_or_unusable_are_refused(media_dir, path, words):
    with pytest.raises(MediaError, match=words) as err:
        MediaConnector(media_dir).fetch_image("file://" + path.format(root=media_dir), PART)
    assert err.value.param == PART


def test_a_file_url_names_this_machine(media_dir):
    with pytest.raises(MediaError, match="host 'example.com'"):
        MediaConnector(media_dir).fetch_image(f"file://example.com{media_dir}/sub/cat.png", PART)


def test_the_allowed_path_must_be_a_folder(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        MediaConnector(tmp_path / "nowhere")


def test_offline_chat_images_decode_as_the_servers():
    """The processor's own image parts (LLM.chat: data: URLs, PIL images) go through the same decoding and checks:
    a transparent image is the same RGB picture offline and served, a truncated one is refused offline too."""
    from pagedmlx.multimodal.processor import decode_image_url, to_pil

    rgba = Image.new("RGBA", (8, 8), (10, 20, 30, 0))
    served = MediaConnector().fetch_image(data_url(encode(rgba)), PART)
    assert decode_image_url(data_url(encode(rgba))).tobytes() == served.tobytes() == to_pil(rgba).tobytes()
    with pytest.raises(ValueError, match="truncated or corrupt"):
        decode_image_url(data_url(png()[:-30]))
