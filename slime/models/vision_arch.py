"""What a vision + text checkpoint's vision side is, in one frozen record the builder, the data packing and the
weight mapping read (`VisionArch`); importing this module needs neither torch, megatron nor transformers.

A family that trains a composite checkpoint with its vision tower says so with `ModelFamily.vision` (hf_config ->
VisionArch). The tower is transformers' own class of the checkpoint's `vision_config` (every field of it honoured
by that class), with the checkpoint's parameter names under `hf_prefix`; the text model is megatron's. Image
tokens are the prompt's runs of `image_token_id`, each image `grid_t x grid_h x grid_w / merge_size^2` of them,
placed by multimodal RoPE's three position rows (slime/models/mrope.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime.models.hf_fields import CONFIG_OBJECT, built, checked, ignored, table

VISION_ATTRIBUTE = "slime_vision_arch"
"""Set on the text config `registry.language_model_config` returns when the run trains on images: its VisionArch."""
VISION_MODULE = "visual"
"""The megatron model's attribute holding the vision tower: parameter `visual.X` is the checkpoint's `{hf_prefix}X`."""


@dataclass(frozen=True)
class MultimodalRope:
    """How the three position rows share a head's rotary frequency pairs."""

    section: tuple[int, int, int]
    """Frequency pairs driven by the temporal, height and width rows (they sum to the rotated dims / 2)."""
    interleaved: bool
    """Qwen3-VL / Qwen3.5: pair i takes the height row when i % 3 == 1 and i < 3 x section[1], the width row when
    i % 3 == 2 and i < 3 x section[2], else the temporal row; Qwen2(.5)-VL: contiguous runs of pairs per row."""


@dataclass(frozen=True)
class VisionArch:
    """The vision side of a composite checkpoint the trainer builds."""

    family: str
    """The family's name, for messages."""
    vision_config: Any
    """transformers' vision config object: the tower is its own class (AutoModel.from_config)."""
    image_token_id: int
    merge_size: int
    """Patches merged per side into one image token (vision_config.spatial_merge_size)."""
    rope: MultimodalRope
    deepstack_layers: int = 0
    """Qwen3-VL's deepstack: the tower's extra feature maps are added to the image tokens' hidden states after each of
    the first `deepstack_layers` decoder layers (0: none)."""
    hf_prefix: str = "model.visual."
    """Where the tower's tensors sit in the checkpoint."""

    @property
    def tokens_per_image_divisor(self) -> int:
        return self.merge_size ** 2


def mrope_of(text_config: Any, interleaved: bool) -> MultimodalRope:
    """The text config's `rope_parameters.mrope_section` (transformers 5; `rope_scaling` in 4.x) with the family's
    layout; ValueError when it is missing or does not cover the rotated dimensions."""
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    section = params.get("mrope_section")
    if not section or len(section) != 3:
        raise ValueError(f"config.json text_config.rope_parameters.mrope_section is {section!r}: a vision + text "
                         "checkpoint needs the three multimodal RoPE sections (temporal, height, width)")
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    percent = params.get("partial_rotary_factor") or getattr(text_config, "partial_rotary_factor", None) or 1.0
    pairs = int(head_dim * percent) // 2
    if sum(section) != pairs:
        raise ValueError(f"config.json text_config.rope_parameters.mrope_section {list(section)} sums to "
                         f"{sum(section)}, but each head rotates {pairs} frequency pairs")
    return MultimodalRope(section=tuple(int(s) for s in section), interleaved=interleaved)


def qwen_vision_arch(hf_config: Any, family: str, *, interleaved: bool, deepstack: bool = False,
                     hf_prefix: str = "model.visual.") -> VisionArch:
    """The Qwen-VL kind of composite config (Qwen2.5-VL, Qwen3-VL, Qwen3.5): `vision_config`, `image_token_id`,
    the text config's multimodal RoPE sections; Qwen3-VL's `deepstack_visual_indexes`."""
    vision = hf_config.vision_config
    layers = len(getattr(vision, "deepstack_visual_indexes", None) or ()) if deepstack else 0
    return VisionArch(family=family, vision_config=vision, image_token_id=int(hf_config.image_token_id),
                      merge_size=int(vision.spatial_merge_size), rope=mrope_of(hf_config.text_config, interleaved),
                      deepstack_layers=layers, hf_prefix=hf_prefix)


def _text_tying(value: Any, hf_config: Any) -> str | None:
    text = getattr(hf_config.text_config, "tie_word_embeddings", False)
    if bool(value) == bool(text):
        return None
    return (f"disagrees with text_config.tie_word_embeddings={text}: transformers' composite model ties by the "
            "outer one, the text model is built by the inner one; make them equal")


QWEN_VL_COMPOSITE_FIELDS = table(
    CONFIG_OBJECT,
    text_config=built("the text model (hf_fields of the family), megatron's"),
    vision_config=built("the vision tower, transformers' own class of it (every field read by that class), built and "
                        "trained when the run trains on images (--multimodal-keys), else carried through unchanged"),
    image_token_id=built("the image tokens, whose word embeddings the vision features replace"),
    video_token_id=ignored("videos are refused before any engine or trainer sees one"),
    vision_start_token_id=ignored("a text token around each image: its place comes from the image token runs"),
    vision_end_token_id=ignored("a text token around each image: its place comes from the image token runs"),
    tie_word_embeddings=checked("text_config.tie_word_embeddings", _text_tying, True),
)
"""The vision + text wrapper of the Qwen-VL kind (Qwen2.5-VL, Qwen3-VL, Qwen3.5)."""


@dataclass(frozen=True)
class VisionBatch:
    """What one packed micro-batch gives the vision side."""

    position_rows: Any
    """[3, whole packed length] long: multimodal RoPE positions (temporal, height, width) of every token of the
    micro-batch (all CP ranks' tokens, each sequence counted from 0)."""
    feature_index: Any
    """[this rank's tokens] long: the image-feature row each image token takes (features of the micro-batch's
    images in packed order), -1 for every other token."""
    pixel_values: Any = None
    """[patches, channels x temporal patch x patch x patch] of the micro-batch's images in packed order; None when
    it has none."""
    image_grid_thw: Any = None
    """[images, 3] long."""


def vision_arch_of(model: Any) -> VisionArch | None:
    """The VisionArch of a (wrapped) model chunk, None for a text model."""
    while hasattr(model, "module"):
        model = model.module
    return getattr(model, "vision_arch", None)
