"""Images of prompt rows, read into one canonical form: a `data:image/...;base64,...` URI of RGB image bytes.

A row may give an image as a local path (relative paths are read from the prompt file's directory), a base64
string or data URI, raw bytes, a parquet image struct (`{"bytes": ..., "path": ...}`, as HF datasets write
images) or a rich item `{"type": "image", "image": ...}`. URLs are refused: the machines that train are offline,
and an image fetched at rollout time could differ from the one checked before the run. Every image is decoded
here, so a broken file fails when the prompts are checked, not in an engine.

The canonical bytes are what the engines and the trainer's processor both decode: an RGB image without an EXIF
rotation keeps its own bytes; any other (palette, alpha, grey, rotated) is converted to RGB, as transformers'
image processors do, and stored as PNG, so both sides see the same pixels.
"""
from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

DATA_URI_PREFIX = "data:image/"
URL_SCHEMES = ("http://", "https://", "ftp://", "s3://", "gs://")
# Keys of Qwen-VL's rich image items that ask for a per-image size: the size bound is the processor's instead.
PER_IMAGE_SIZE_KEYS = ("min_pixels", "max_pixels", "resized_height", "resized_width")
_EXIF_ORIENTATION = 0x0112


class ImageInputError(ValueError):
    """An image of a prompt row that cannot be used; the message says which and why."""


def canonical_image(value: Any, base_dir: Path | None = None) -> str:
    """The data URI of one image value of a prompt row (see the module docstring for what is accepted)."""
    return encode_data_uri(*_canonical_bytes(_raw_bytes(value, base_dir)))


def encode_data_uri(data: bytes, image_format: str) -> str:
    return f"{DATA_URI_PREFIX}{image_format.lower()};base64,{base64.b64encode(data).decode('ascii')}"


def data_uri_bytes(uri: str) -> bytes:
    """The image bytes of a data URI written by `canonical_image`."""
    if not uri.startswith(DATA_URI_PREFIX) or ";base64," not in uri:
        raise ImageInputError(f"not an image data URI: {uri[:40]!r}")
    return base64.b64decode(uri.split(";base64,", 1)[1], validate=True)


def open_image(uri: str):
    """The decoded RGB PIL image of a canonical data URI."""
    from PIL import Image

    image = Image.open(io.BytesIO(data_uri_bytes(uri)))
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


def _raw_bytes(value: Any, base_dir: Path | None) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, dict):
        return _dict_bytes(value, base_dir)
    if isinstance(value, str):
        return _string_bytes(value, base_dir)
    raise ImageInputError(f"an image must be a path, a base64 string, bytes or a {{'bytes', 'path'}} struct, got "
                          f"a {type(value).__name__}")


def _dict_bytes(value: dict, base_dir: Path | None) -> bytes:
    sized = [key for key in PER_IMAGE_SIZE_KEYS if key in value]
    if sized:
        raise ImageInputError(f"per-image sizes ({', '.join(sized)}) are not supported: every image is resized "
                              "within the checkpoint processor's min/max pixels (preprocessor_config.json); drop them")
    if value.get("type") == "image" or "image" in value:
        if "image" not in value:
            raise ImageInputError("an {'type': 'image'} item has no 'image' value")
        return _raw_bytes(value["image"], base_dir)
    if value.get("bytes") is not None:
        return _raw_bytes(value["bytes"], base_dir)
    if value.get("path"):
        return _string_bytes(str(value["path"]), base_dir)
    raise ImageInputError(f"an image struct needs 'bytes' or 'path' (or 'image'), got keys {sorted(value)}")


def _string_bytes(value: str, base_dir: Path | None) -> bytes:
    text = value.strip()
    if text.lower().startswith(URL_SCHEMES):
        raise ImageInputError(f"{text[:80]!r} is a URL: images are not downloaded (the machines that train are "
                              "offline, and a fetched image could change between the check and the rollout); "
                              "download them and give local paths, base64 strings or bytes")
    if text.startswith("data:"):
        try:
            return data_uri_bytes(text)
        except (ImageInputError, binascii.Error, ValueError):
            raise ImageInputError(f"{text[:40]!r}... is not a base64 image data URI") from None
    path = Path(text)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if _is_file(path):
        return path.read_bytes()
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(f"{text[:80]!r} is neither an image file (looked for {path}) nor a base64 "
                              "string") from None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a base64 string too long to be a file name
        return False


def _canonical_bytes(data: bytes) -> tuple[bytes, str]:
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageInputError(f"cannot be decoded as an image ({type(exc).__name__}: {exc})") from None
    rotated = image.getexif().get(_EXIF_ORIENTATION, 1) != 1
    if image.mode == "RGB" and not rotated and image.format:
        return data, image.format
    if rotated:
        image = ImageOps.exif_transpose(image)
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue(), "PNG"
