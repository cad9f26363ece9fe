"""Image decoding that mmkv does itself: bytes, PIL images or data: URLs, never a URL fetch or a
path open. The content hash is xxh3-128 over the decoded RGB pixels and the size.

A `PreparedImage` is what the engine needs of an image, made without the engine's lock
(`Engine.prepare_image`): the hash, the vision tower's input, and a compact source to remake that
input after an eviction (the encoded upload, or an RGB no larger than the processor's max_pixels),
never the full-resolution RGB.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash
from PIL import Image, ImageOps, UnidentifiedImageError

if TYPE_CHECKING:  # torch is only a type here: the server's light modules import this without it
    import torch

from mmkv.errors import ImageTooLargeError, ImageURLNotAllowedError, InvalidImageError

MIN_SIDE = 8  # px; below this an image has no content a 14-16 px patch can resolve
MAX_ASPECT = 200  # Qwen's smart_resize refuses more extreme ratios
DEFAULT_MAX_IMAGE_PIXELS = 64_000_000  # hard limit, checked on the header before decoding


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB
    content_hash: str  # 32 hex digits, xxh3-128 of (width, height, RGB bytes)
    source_bytes: int
    encoded: bytes | None = None  # the bytes it was decoded from (None for a PIL image)

    @property
    def width(self) -> int:
        return self.image.width

    @property
    def height(self) -> int:
        return self.image.height


@dataclass(frozen=True)
class PreparedImage:
    """An image decoded, hashed and preprocessed for the vision tower. Immutable; the engine keeps
    `source` (counted in its image-store budget) and drops `pixel_values` once precompiled."""

    content_hash: str
    width: int  # of the decoded original
    height: int
    source_bytes: int  # bytes of the upload it was decoded from (0 for a PIL image)
    source: bytes | Image.Image  # the encoded upload, or an RGB of at most max_pixels: remakes pixel_values
    pixel_values: torch.Tensor  # [patches, channels * temporal * patch * patch], the vision tower's input
    grid_thw: tuple[int, int, int]

    @property
    def source_nbytes(self) -> int:
        return len(self.source) if isinstance(self.source, bytes) else self.source.width * self.source.height * 3


def bytes_from_data_url(url: str, what: str = "image", not_allowed=ImageURLNotAllowedError,
                        invalid=InvalidImageError) -> bytes:
    """The payload of a base64 data: URL; any other scheme is refused (never fetched). `what` and
    the two error types name the media (images here, videos in mmkv.video)."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "a path"
        raise not_allowed(f"{what} URLs with scheme {scheme!r} are not fetched; send a data: URL or upload the file "
                          "and use its id")
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise invalid(f"data: URL {what}s must be base64 encoded")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise invalid(f"data: URL is not valid base64: {exc}") from exc


def _open(data: bytes, max_pixels: int) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > max_pixels:
                raise ImageTooLargeError(
                    f"image is {img.width}x{img.height} = {img.width * img.height} pixels, over the limit of {max_pixels}"
                )
            img.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLargeError(f"image rejected by the decompression-bomb guard: {exc}") from exc
    except ImageTooLargeError:
        raise
    except UnidentifiedImageError as exc:  # its message names a BytesIO object, which helps no one
        raise InvalidImageError("cannot decode image: not a PNG, JPEG, GIF, WebP or other format Pillow "
                                "reads") from exc
    except Exception as exc:  # Pillow raises many types for corrupt data
        raise InvalidImageError(f"cannot decode image: {exc}") from exc
    return img


def to_rgb(img: Image.Image) -> Image.Image:
    """Apply EXIF orientation; composite transparency onto white (as qwen-vl-utils does)."""
    img = ImageOps.exif_transpose(img)
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def decode_image(data, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> DecodedImage:
    """bytes | PIL.Image | data: URL -> validated RGB image with its content hash."""
    if isinstance(data, Image.Image):
        if data.width * data.height > max_pixels:
            raise ImageTooLargeError(f"image has {data.width * data.height} pixels, over the limit of {max_pixels}")
        raw, source_bytes, encoded = data, 0, None
    else:
        if isinstance(data, str):
            data = bytes_from_data_url(data)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidImageError(f"cannot read an image from a {type(data).__name__}")
        data = bytes(data)
        if not data:
            raise InvalidImageError("image data is empty")
        raw, source_bytes, encoded = _open(data, max_pixels), len(data), data
    img = to_rgb(raw)
    w, h = img.size
    if min(w, h) < MIN_SIDE:
        raise InvalidImageError(f"image is {w}x{h}; each side must be at least {MIN_SIDE} px")
    if max(w, h) / min(w, h) > MAX_ASPECT:
        raise InvalidImageError(f"image is {w}x{h}; the aspect ratio must be at most {MAX_ASPECT}:1")
    digest = xxhash.xxh3_128(f"{w}x{h}|".encode() + img.tobytes()).hexdigest()
    return DecodedImage(img, digest, source_bytes, encoded)
