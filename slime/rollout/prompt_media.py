"""Images of prompt rows (`--multimodal-keys`), read as upstream reads them, without torch.

`--multimodal-keys '{"image": "images"}'` names the row key that holds each media type. A row's prompt text
marks where each image goes with `<image>` (upstream's placeholder), one per image in the row's list, in order;
the chat template then renders each as the model's own image tokens. Images are checked and normalised by
slime/utils/images.py. Video and audio are refused: no engine or trainer here processes them.

A run with `--multimodal-keys` trains on images: the trainer builds the checkpoint's vision tower in front of its
text model (slime/models/vision_language.py); the checkpoint's family must be one that does
(`registry.vision_model_types()`), checked before Ray starts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime.utils.images import ImageInputError, canonical_image

UNTRAINED_IMAGES = ("the trainer builds the vision tower only for a run with --multimodal-keys, so its log-probs "
                    "would ignore the images the engines saw")

IMAGE_PLACEHOLDER = "<image>"  # upstream's MultimodalTypes.IMAGE.placeholder
MEDIA_TYPES = ("image", "video", "audio")
REFUSED_MEDIA = {
    "video": "videos are not supported: neither the embedded engine nor the trainer processes video frames",
    "audio": "audio is not supported: no audio encoder is built here",
}


@dataclass(frozen=True)
class MediaKeys:
    """The row key of each media type (`--multimodal-keys`); only images are accepted."""

    image: str

    def as_dict(self) -> dict[str, str]:
        return {"image": self.image}


def parse_media_keys(value: Any, flag: str = "--multimodal-keys") -> MediaKeys | None:
    """The checked mapping (None when the flag is unset); ValueError naming what to fix."""
    if value is None:
        return None
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{flag} must be a JSON object of media type -> row key, e.g. '{{\"image\": \"images\"}}'; "
                         f"got {value!r}")
    for media, key in value.items():
        if media not in MEDIA_TYPES:
            raise ValueError(f"{flag}: unknown media type {media!r} (upstream's are {', '.join(MEDIA_TYPES)})")
        if media in REFUSED_MEDIA:
            raise ValueError(f"{flag}: {media!r} -> {key!r} is refused: {REFUSED_MEDIA[media]}")
        if not isinstance(key, str) or not key:
            raise ValueError(f"{flag}: the row key of {media!r} must be a non-empty string, got {key!r}")
    return MediaKeys(image=value["image"])


def row_images(row: dict, keys: MediaKeys, where: str, base_dir: Path | None) -> list[str]:
    """The row's images as canonical data URIs; a row whose image key holds null (or []) has none."""
    if keys.image not in row:
        raise ValueError(f"{where}: image key {keys.image!r} missing (keys: {sorted(row)}); set --multimodal-keys "
                         "to the key holding the images, or give the row an empty list")
    value = row[keys.image]
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) or _is_array(value) else [value]
    images = []
    for index, item in enumerate(items):
        try:
            images.append(canonical_image(item, base_dir))
        except ImageInputError as exc:
            raise ValueError(f"{where}: image {index} of {keys.image!r}: {exc}") from None
    return images


def _is_array(value: Any) -> bool:
    return type(value).__name__ == "ndarray"  # a list column read through numpy


def image_messages(prompt: Any, num_images: int, where: str) -> list[dict]:
    """The chat messages of a prompt with each `<image>` turned into an image item, as upstream builds them:
    text content is split around the placeholders; a prompt string becomes one user message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    placed = 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(f"{where}: a message's content is a {type(content).__name__}; with --multimodal-keys "
                             f"it must be text that marks each image with {IMAGE_PLACEHOLDER}")
        parts = []
        for segment in re.split(f"({re.escape(IMAGE_PLACEHOLDER)})", content):
            if segment == IMAGE_PLACEHOLDER:
                parts.append({"type": "image"})
                placed += 1
            elif segment:
                parts.append({"type": "text", "text": segment})
        message["content"] = parts
    if placed != num_images:
        raise ValueError(f"{where}: the prompt has {placed} {IMAGE_PLACEHOLDER} placeholder(s) for {num_images} "
                         f"image(s); put one {IMAGE_PLACEHOLDER} where each image goes, in order")
    return messages


def check_media_rows(rows, keys: MediaKeys, flag: str, path: str, input_key: str) -> int:
    """Every row's images decode and match its placeholders; returns the number of images. `rows` yields
    (line number, row) as prompt_rows.read_rows does."""
    base_dir = Path(path).resolve().parent
    count = 0
    for lineno, row in rows:
        where = f"{flag}: {path}:{lineno}"
        images = row_images(row, keys, where, base_dir)
        if input_key in row:
            image_messages(row[input_key], len(images), where)
        count += len(images)
    return count
