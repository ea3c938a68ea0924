"""A vision + text checkpoint's prompt processing: image tokens, pixel values and grids, as its HF processor gives.

Qwen2-VL's image processor and its successors' (Qwen2.5-VL, Qwen3-VL, Qwen3.5) resize each image within the
processor's min/max pixels (preprocessor_config.json) to a multiple of patch x merge size and cut it into
patches: `pixel_values` [patches, channels x temporal patch x patch x patch] and `image_grid_thw` [images, 3]. The
processor then repeats the image placeholder token that the chat template wrote once per image
(`<|image_pad|>`) grid_t x grid_h x grid_w / merge_size^2 times. transformers' processor classes for these models
cannot be built without torchvision (they hold a video processor); this class is the same computation from the
checkpoint's image processor and tokenizer, checked equal to transformers' processors by
tests/test_vision_processor.py. Images are canonical data URIs (slime/utils/images.py).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from slime.utils.images import open_image

PREPROCESSOR_FILE = "preprocessor_config.json"
# Processed images kept per process (a prompt's group shares one entry, so its samples share the tensors).
PROCESSED_CACHE_SIZE = 64


@dataclass(frozen=True)
class ProcessedImages:
    """One prompt's images as the vision tower takes them; shared between the samples of a group: read-only."""

    pixel_values: torch.Tensor
    """[patches of all images, channels x temporal patch x patch x patch], the image processor's dtype (fp32)."""
    image_grid_thw: torch.Tensor
    """[images, 3] int64: temporal, height and width patches of each image."""

    def as_train_inputs(self) -> dict[str, torch.Tensor]:
        """Upstream's Sample.multimodal_train_inputs: the processor's outputs other than the text's."""
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}


def has_vision(checkpoint: str | None) -> bool:
    """Whether a checkpoint directory is a vision + text one with an image processor."""
    if not checkpoint:
        return False
    config = Path(checkpoint) / "config.json"
    return (Path(checkpoint) / PREPROCESSOR_FILE).is_file() and config.is_file() \
        and "vision_config" in json.loads(config.read_text())


def load_vision_processor(checkpoint: str, tokenizer=None) -> "VisionProcessor | None":
    """The checkpoint's processor, or None for a checkpoint without a vision tower and image processor."""
    if not has_vision(checkpoint):
        return None
    return VisionProcessor.from_checkpoint(checkpoint, tokenizer)


class VisionProcessor:
    """Text with one image placeholder per image -> token ids with the image tokens expanded; images -> pixels."""

    def __init__(self, tokenizer, image_processor, image_token_id: int, where: str = "the checkpoint") -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = int(image_token_id)
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.merge_size = getattr(image_processor, "merge_size", None)
        if not isinstance(self.merge_size, int) or not hasattr(image_processor, "get_number_of_image_patches"):
            raise ValueError(f"{where}: its image processor {type(image_processor).__name__} is not one of "
                             "Qwen2-VL's kind (merge_size, image_grid_thw); images are supported for the Qwen2-VL, "
                             "Qwen2.5-VL, Qwen3-VL and Qwen3.5 processors")
        self.processed = functools.lru_cache(maxsize=PROCESSED_CACHE_SIZE)(self._process)

    @classmethod
    def from_checkpoint(cls, checkpoint: str, tokenizer=None) -> "VisionProcessor":
        from transformers import AutoImageProcessor, AutoTokenizer

        config = json.loads((Path(checkpoint) / "config.json").read_text())
        image_token_id = config.get("image_token_id", config.get("image_token_index"))
        if image_token_id is None:
            raise ValueError(f"--hf-checkpoint {checkpoint}: config.json names no image_token_id, so the image "
                             "placeholder of its prompts is unknown")
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=True,
                                                               local_files_only=True)
        image_processor = AutoImageProcessor.from_pretrained(checkpoint, local_files_only=True)
        processor = cls(tokenizer, image_processor, image_token_id, where=f"--hf-checkpoint {checkpoint}")
        processor.check_vision_config(config.get("vision_config") or {}, f"--hf-checkpoint {checkpoint}")
        return processor

    def check_vision_config(self, vision: dict, where: str) -> None:
        """The image processor's patching must be the vision tower's, else its patches do not fit the tower."""
        pairs = (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                 ("temporal_patch_size", "temporal_patch_size"))
        for mine, theirs in pairs:
            have, want = getattr(self.image_processor, mine, None), vision.get(theirs)
            if want is not None and have != want:
                raise ValueError(f"{where}: {PREPROCESSOR_FILE} has {mine} {have}, the vision tower's config "
                                 f"{theirs} {want}: make them agree")

    # ----- token ids ---------------------------------------------------------------------------------------
    def tokens_of(self, image_uri: str) -> int:
        """Image tokens one image becomes (its patches / merge_size^2), from its size alone."""
        width, height = _image_size(image_uri)
        return self.image_processor.get_number_of_image_patches(height, width) // self.merge_size ** 2

    def prompt_ids(self, text: str, images: Sequence[str]) -> list[int]:
        """Token ids of a rendered prompt with each image's placeholder repeated for that image's tokens."""
        return self.expanded_ids(text, [self.tokens_of(uri) for uri in images])

    def expanded_ids(self, text: str, counts: Sequence[int]) -> list[int]:
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(counts):
            raise ValueError(f"the prompt has {len(pieces) - 1} {self.image_token} placeholder(s) for {len(counts)} "
                             "image(s): the chat template must render one per image")
        expanded = pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:]))
        return list(self.tokenizer(expanded, add_special_tokens=False)["input_ids"])

    def tokens_per_image(self, processed: ProcessedImages) -> list[int]:
        return [int(t * h * w) // self.merge_size ** 2 for t, h, w in processed.image_grid_thw.tolist()]

    def expand_runs(self, input_ids: Sequence[int], processed: ProcessedImages) -> list[int]:
        """Token ids whose k-th run of image tokens is image k's exact count (SGLang takes a run of any length
        for one image, and so does this)."""
        counts, out, run = self.tokens_per_image(processed), [], 0
        for position, token in enumerate(input_ids):
            if token != self.image_token_id:
                out.append(token)
                continue
            if position and input_ids[position - 1] == self.image_token_id:
                continue
            if run == len(counts):
                raise ValueError(f"the prompt has more image-token runs than the {len(counts)} image(s) sent")
            out += [self.image_token_id] * counts[run]
            run += 1
        if run != len(counts):
            raise ValueError(f"the prompt has {run} image-token run(s) for {len(counts)} image(s)")
        return out

    # ----- pixels ------------------------------------------------------------------------------------------
    def _process(self, images: tuple[str, ...]) -> ProcessedImages:
        out = self.image_processor(images=[open_image(uri) for uri in images], return_tensors="pt")
        return ProcessedImages(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"].long())

    def process(self, images: Sequence[str]) -> ProcessedImages:
        """Pixel values and grids of a prompt's images (cached: the samples of a group share the result)."""
        return self.processed(tuple(images))

    # ----- upstream's processor call -----------------------------------------------------------------------
    def __call__(self, text: str | list[str], images: Sequence[Any] | None = None, videos: Any = None,
                 **kwargs: Any) -> dict[str, Any]:
        """`processor(text=..., images=[...])` as plug-ins call an HF processor: input_ids (a list per text),
        pixel_values and image_grid_thw; images as data URIs, paths, bytes or PIL images."""
        if videos is not None or kwargs.get("audio") is not None:
            raise ValueError("videos and audio are not supported")
        texts = [text] if isinstance(text, str) else list(text)
        uris = [image_uri(image) for image in images or []]
        if len(texts) != 1 and uris:
            raise ValueError("one text at a time with images")
        if not uris:
            return {"input_ids": [self.expanded_ids(t, []) for t in texts]}
        processed = self.process(uris)
        return {"input_ids": [self.expanded_ids(texts[0], self.tokens_per_image(processed))],
                **processed.as_train_inputs()}


def image_uri(image: Any) -> str:
    """A canonical data URI (slime/utils/images.py) of an image given as one, or as a path, base64 string,
    bytes or PIL image (what upstream's plug-ins put in Sample.multimodal_inputs)."""
    from slime.utils.images import DATA_URI_PREFIX, canonical_image

    if isinstance(image, str) and image.startswith(DATA_URI_PREFIX):
        return image
    if hasattr(image, "save") and hasattr(image, "mode"):  # a PIL image
        import io

        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="PNG")
        image = buffer.getvalue()
    return canonical_image(image)


def images_digest(images: Sequence[str]) -> str:
    """Names a prompt's images (Sample.multimodal_train_input_id): samples of one prompt share it."""
    import hashlib

    digest = hashlib.sha256()
    for uri in images:
        digest.update(uri.encode("ascii"))
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _image_size(uri: str) -> tuple[int, int]:
    """(width, height) of the image as decoded (canonical images carry no EXIF rotation)."""
    import io

    from PIL import Image

    from slime.utils.images import data_uri_bytes

    with Image.open(io.BytesIO(data_uri_bytes(uri))) as image:
        return image.size
