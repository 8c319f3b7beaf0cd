"""Images from OpenAI chat content parts (vLLM's MediaConnector): `data:image/...;base64,` URLs, and local
`file://` paths under `allowed_local_media_path` (vLLM's --allowed-local-media-path). Remote http(s) URLs
are refused: this engine runs where there may be no internet, and a fetch would hold the request on
another server's time. Every image is decoded whole and checked here (format, size, truncation), so that
a bad payload is a MediaError naming its part, never a failure in the processor or the engine later.

Limits (per image): MAX_IMAGE_BYTES encoded, MAX_IMAGE_PIXELS decoded (width x height, read from the
header before anything is decoded: a decompression bomb is refused unread), formats in IMAGE_FORMATS
(Pillow's decoders for them; formats that Pillow hands to outside programs, like EPS, are never opened).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

from PIL import Image, UnidentifiedImageError
# The decoders of IMAGE_FORMATS, registered (Image.open(formats=...) looks only among registered ones)
from PIL import (BmpImagePlugin, GifImagePlugin, JpegImagePlugin, PngImagePlugin, TiffImagePlugin,  # noqa: F401
                 WebPImagePlugin)

MAX_IMAGE_BYTES = 20 * 2**20  # OpenAI's limit for one image
MAX_IMAGE_PIXELS = 8192 * 8192  # 67 Mpx: 200 MB as RGB; a 48 Mpx phone photo fits
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG includes MPO (phone cameras)


class MediaError(ValueError):
    """A content part that gives no usable image; `param` names it (`messages[0].content[1].image_url`)."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class MediaConnector:
    """Loads the images of content parts. `allowed_local_media_path`: the folder `file://` URLs may read
    from (None: no local files)."""

    allowed_local_media_path: Optional[Path] = None
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        if self.allowed_local_media_path is not None:
            path = Path(self.allowed_local_media_path).resolve()
            if not path.is_dir():
                raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path}: not a folder")
            object.__setattr__(self, "allowed_local_media_path", path)

    def fetch_image(self, url: str, param: str = "image_url") -> Image.Image:
        """The image `url` gives, decoded and checked, as RGB. MediaError (naming `param`) otherwise."""
        scheme = url[:16].partition(":")[0].lower() if ":" in url[:16] else ""
        if scheme == "data":
            data = self._load_data_url(url, param)
        elif scheme == "file":
            data = self._load_file_url(url, param)
        elif scheme in ("http", "https"):
            raise MediaError("fetching remote images (http and https URLs) is not available on this server: "
                             "send the image in the request as a data URL (data:image/png;base64,...)", param)
        else:
            raise MediaError(f"the URL must be a data URL (data:image/...;base64,...) or, where the server "
                             f"allows local files, a file:// URL; got {url[:40]!r}", param)
        return self.decode_image(data, param)

    def _load_data_url(self, url: str, param: str) -> bytes:
        header, comma, data = url.partition(",")
        media_type, *options = header[len("data:"):].split(";")
        if not comma or "base64" not in options:
            raise MediaError("a data URL must be base64-encoded (data:image/png;base64,...)", param)
        if not media_type.lower().startswith("image/"):
            raise MediaError(f"a data URL must hold an image (data:image/...), got the media type "
                             f"{media_type[:40]!r}", param)
        if len(data) // 4 * 3 > self.max_image_bytes + 3:
            raise MediaError(f"the image is larger than {self.max_image_bytes} bytes", param)
        try:
            return base64.b64decode(data, validate=False)
        except (binascii.Error, ValueError) as exc:
            raise MediaError(f"the data URL is not valid base64 ({exc})", param) from None

    def _load_file_url(self, url: str, param: str) -> bytes:
        root = self.allowed_local_media_path
        if root is None:
            raise MediaError("cannot load local files: the server was started without --allowed-local-media-path",
                             param)
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(f"a file URL names a file on this machine (file:///path), got host {parts.netloc!r}",
                             param)
        path = Path(url2pathname(unquote(parts.path))).resolve()  # symlinks and .. resolved before the check
        if not path.is_relative_to(root):
            raise MediaError("the file must be under the folder the server allows (--allowed-local-media-path)", param)
        try:
            # O_NONBLOCK: a FIFO or a device in the folder must not hold the request (it is refused below)
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            raise MediaError(f"cannot read the file ({exc.strerror})", param) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise MediaError("the path is not a regular file", param)
            if info.st_size > self.max_image_bytes:
                raise MediaError(f"the image is larger than {self.max_image_bytes} bytes", param)
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(self.max_image_bytes + 1)
        finally:
            os.close(fd)
        if len(data) > self.max_image_bytes:
            raise MediaError(f"the image is larger than {self.max_image_bytes} bytes", param)
        return data

    def decode_image(self, data: Union[bytes, bytearray], param: str = "image") -> Image.Image:
        """`data` (an encoded image) decoded whole, as RGB; MediaError where it is not an image in
        IMAGE_FORMATS, is truncated or corrupt, or is over the limits."""
        if len(data) > self.max_image_bytes:
            raise MediaError(f"the image is larger than {self.max_image_bytes} bytes", param)
        if not data:
            raise MediaError("the image is empty", param)
        try:
            # Pillow only warns between its own limit and twice that (89 and 179 Mpx): the check below refuses those
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as probe:
                width, height = probe.size
                if width * height > self.max_image_pixels:
                    raise MediaError(f"the image is {width} x {height} pixels, over the limit of "
                                     f"{self.max_image_pixels} pixels", param)
                probe.verify()  # chunk checksums (PNG); then the whole image is decoded anew
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
                image.load()
                return to_rgb(image)
        except MediaError:
            raise
        except UnidentifiedImageError:
            raise MediaError(f"not an image, or not one of the formats served ({', '.join(IMAGE_FORMATS)})",
                             param) from None
        except Image.DecompressionBombError:
            raise MediaError(f"the image is over the limit of {self.max_image_pixels} pixels", param) from None
        except Exception as exc:  # noqa: BLE001 - truncated or corrupt data: whatever the decoder raises
            raise MediaError(f"the image could not be decoded: it is truncated or corrupt "
                             f"({type(exc).__name__}: {exc})", param) from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, as vLLM's image loader gives: transparency over a white background (not black)."""
    if image.mode == "RGB":
        return image.copy()
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
