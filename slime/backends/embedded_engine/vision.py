"""Images on the embedded engine: a vision + text checkpoint served by transformers' composite class.

A checkpoint with a vision tower and an image processor (slime/utils/vision_processor.py's `has_vision`) loads
as AutoModelForImageTextToText (Qwen2.5-VL, Qwen3-VL, Qwen3.5, ...); a /generate request's `image_data` goes
through the checkpoint's image processor, and the prompt's k-th run of image tokens becomes image k's count, as
SGLang expands them. The prefill hands the model the pixel values and grids of the batch's images in row order;
positions are multimodal RoPE's three rows (temporal, height, width) from the model's own `get_rope_index`, and
every generated token sits one past its row's largest position, the same on all three rows.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from slime.models.mxfp4 import dequantising_load
from slime.utils.images import ImageInputError, canonical_image
from slime.utils.vision_processor import ProcessedImages, VisionProcessor, has_vision, load_vision_processor


def load_model(model_path: str, dtype: torch.dtype, tokenizer) -> tuple[Any, VisionProcessor | None]:
    """The model to serve and, for a vision + text checkpoint, its image processing."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if has_vision(model_path):
        return (AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype),
                load_vision_processor(model_path, tokenizer))
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **dequantising_load(model_path)), None


def request_images(image_data: Any, num_prompts: int, is_batch: bool) -> list[list[str] | None]:
    """SGLang's `image_data` per prompt: one image or a list of them for a single prompt; for a batch, one entry
    (an image, a list or null) per prompt. Each image as canonical data URI (URLs refused: the engine is offline)."""
    if image_data is None or image_data == []:
        return [None] * num_prompts
    entries = image_data if is_batch else [image_data]
    if not isinstance(entries, list) or len(entries) != num_prompts:
        raise ValueError(f"image_data must have one entry per prompt ({num_prompts})")
    out = []
    for entry in entries:
        items = entry if isinstance(entry, list) else [entry] if entry is not None else []
        try:
            out.append([canonical_image(item) for item in items] or None)
        except ImageInputError as exc:
            raise ValueError(f"image_data: {exc}") from None
    return out


@dataclass
class MultimodalPositions:
    """The next position of each row (one past its largest prefill position), advanced per generated token."""

    next_position: torch.Tensor  # [rows]

    def step(self) -> torch.Tensor:
        """The [3, rows, 1] positions of the tokens fed now; then one further."""
        positions = self.next_position.view(1, -1, 1).expand(3, -1, 1)
        self.next_position = self.next_position + 1
        return positions


def prefill_inputs(model, vision: VisionProcessor, images: Sequence[ProcessedImages | None], input_ids: torch.Tensor,
                   attention_mask: torch.Tensor) -> tuple[dict[str, Any], MultimodalPositions]:
    """The composite model's prefill keywords (positions, pixel values and grids of the rows' images in order)
    and the positions that follow."""
    present = [item for item in images if item is not None]
    if not present:
        flat = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        positions = flat.unsqueeze(0).expand(3, -1, -1)
        return {"position_ids": positions}, MultimodalPositions(positions.amax(dim=(0, 2)) + 1)
    grid = torch.cat([item.image_grid_thw for item in present])
    token_types = (input_ids == vision.image_token_id).int()
    rope_index = getattr(model, "model", model).get_rope_index
    keywords = dict(image_grid_thw=grid, attention_mask=attention_mask)
    if "mm_token_type_ids" in inspect.signature(rope_index).parameters:
        keywords["mm_token_type_ids"] = token_types
    positions, _ = rope_index(input_ids, **keywords)
    positions = positions.masked_fill(attention_mask.unsqueeze(0) == 0, 0)
    inputs = {"position_ids": positions, "pixel_values": torch.cat([item.pixel_values for item in present]),
              "image_grid_thw": grid}
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        inputs["mm_token_type_ids"] = token_types
    return inputs, MultimodalPositions(positions.amax(dim=(0, 2)) + 1)
