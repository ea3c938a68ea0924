"""Qwen2.5-VL and Qwen3-VL (transformers' Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration):
a vision tower in front of a text model this project builds, the families (`QWEN2_5_VL`, `QWEN3_VL`, at the end).

- Qwen2.5-VL's text model (`qwen2_5_vl_text`) is Qwen2's layers (biases on q/k/v, sliding windows where
  `layer_types` says); its multimodal RoPE gives each row a contiguous run of frequency pairs.
- Qwen3-VL's text model (`qwen3_vl_text`) is Qwen3's layers (RMSNorm on each head's q and k); its multimodal RoPE
  interleaves the rows over the pairs, and its tower's deepstack feature maps are added to the image tokens'
  hidden states after the first decoder layers (one per `deepstack_visual_indexes` entry).
Qwen3-VL's checkpoints keep the text model under `model.language_model.` and the tower under `model.visual.`;
Qwen2.5-VL's keep Qwen2-VL's layout (`model.`, `visual.`, as transformers writes them); the output layer is
`lm_head`. The tower is transformers' own class (slime/models/vision_language.py), built when the run
trains on images.
"""

from __future__ import annotations

from typing import Any

from slime.models.hf_arch import sliding_windows
from slime.models.qwen import QWEN2_FIELDS, QWEN3_FIELDS
from slime.models.registry import ModelFamily, register
from slime.models.vision_arch import QWEN_VL_COMPOSITE_FIELDS, qwen_vision_arch


def qwen2_5_vl_vision(hf_config: Any):
    return qwen_vision_arch(hf_config, "Qwen2.5-VL", interleaved=False, hf_prefix="visual.")


def qwen3_vl_vision(hf_config: Any):
    return qwen_vision_arch(hf_config, "Qwen3-VL", interleaved=True, deepstack=True)


QWEN2_5_VL = register(ModelFamily(name="Qwen2.5-VL", model_types=("qwen2_5_vl_text",), composite_types=("qwen2_5_vl",),
                                  composite_text_prefix="model.", qkv_bias=True, hf_fields=QWEN2_FIELDS, composite_fields=QWEN_VL_COMPOSITE_FIELDS,
                                  attention_windows=sliding_windows, vision=qwen2_5_vl_vision))
QWEN3_VL = register(ModelFamily(name="Qwen3-VL", model_types=("qwen3_vl_text",), composite_types=("qwen3_vl",),
                                qk_layernorm=True, hf_fields=QWEN3_FIELDS, composite_fields=QWEN_VL_COMPOSITE_FIELDS,
                                vision=qwen3_vl_vision))
