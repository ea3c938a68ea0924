"""Qwen3-VL-MoE (transformers' Qwen3VLMoeForConditionalGeneration, `qwen3_vl_moe`): Qwen3-VL's vision tower and
deepstack (slime/models/qwen_vl.py) in front of Qwen3-MoE's text layers, whose checkpoints store each layer's
routed experts fused, the family (`QWEN3_VL_MOE`, at the end).

Text layers (`qwen3_vl_moe_text`): Qwen3's attention (RMSNorm on each head's q and k), interleaved multimodal RoPE,
MoE layers every `decoder_sparse_step` layers but `mlp_only_layers` (dense SwiGLU of `intermediate_size` there): a
softmax router over `num_experts`, top `num_experts_per_tok`, always renormalised (transformers' router has no
`norm_topk_prob`), no shared expert.

The checkpoint (Qwen's released layout, the one SGLang's loader reads):
  model.language_model.layers.L.mlp.gate.weight                [E, H]       router
  model.language_model.layers.L.mlp.experts.gate_up_proj       [E, H, 2I]   in x out; columns [gate (I) | up (I)]
  model.language_model.layers.L.mlp.experts.down_proj          [E, I, H]    in x out
Gate and up are concatenated, not interleaved (transformers splits the output in two halves, SGLang chunks it
in two). megatron's expert e holds its row transposed: fc1 [2I, H] as [gate_r; up_r] per expert-TP rank r, fc2
[H, I] (`stacked_experts`). transformers 5 keeps the experts in memory as [E, 2I, H] / [E, H, I] and reads a
checkpoint by comparing shapes (it transposes a tensor whose shape is not the in-memory one), so a square tensor
(hidden_size equal to 2 x or 1 x moe_intermediate_size) is read untransposed by transformers and transposed by
SGLang: such a config is refused, and so is a checkpoint saved in transformers' in-memory layout. Pushes send the
checkpoint's names and layout; the embedded engine writes them through a transposed view of transformers' tensors
(`in_memory_target`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from slime.models.hf_fields import built, ignored, table
from slime.models.moe_hf import family_moe_names, local_expert
from slime.models.qwen import QWEN3_FIELDS
from slime.models.qwen3_moe import QWEN_MOE_FIELDS, moe_architecture as qwen_moe_architecture
from slime.models.registry import ModelFamily, register
from slime.models.vision_arch import QWEN_VL_COMPOSITE_FIELDS, qwen_vision_arch

FUSED_EXPERTS = ("gate_up_proj", "down_proj")


def moe_architecture(hf_config: Any):
    """Qwen-MoE's layers; the top-k weights are always renormalised (transformers' Qwen3-VL-MoE router)."""
    arch = qwen_moe_architecture(hf_config)
    return None if arch is None else dataclasses.replace(arch, norm_topk_prob=True)


def moe_names(layer_suffix: str, prefix: str, global_expert: int | None, arch: Any) -> tuple[str, ...] | None:
    """The router's name (Qwen-MoE's `mlp.gate.weight`); the routed experts are stacked (`stacked_experts`)."""
    if local_expert(layer_suffix) is not None:
        return None
    return family_moe_names(layer_suffix, prefix, global_expert, arch)


def _gate_up_to_megatron(row, etp: int):
    """HF's [H, 2I] row (columns [gate | up]) -> megatron's fc1 [2I, H]: [gate_r; up_r] per expert-TP rank r."""
    import torch

    gate, up = row.t().chunk(2)
    return torch.cat([torch.cat(pair) for pair in zip(gate.chunk(etp), up.chunk(etp))])


def _gate_up_to_hf(fc1, etp: int):
    """The inverse of _gate_up_to_megatron."""
    import torch

    halves = [chunk.chunk(2) for chunk in fc1.chunk(etp)]
    return torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])]).t()


def stacked_experts(layer_suffix: str, prefix: str, etp: int, hf_config: Any) -> tuple | None:
    """One expert's row of the layer's fused tensors: gate_up_proj's [H, 2I] and down_proj's [I, H], transposed."""
    expert = local_expert(layer_suffix)
    if expert is None or ".bias" in layer_suffix:
        return None
    if expert[1] == "linear_fc2":
        return (f"{prefix}mlp.experts.down_proj",), lambda ts: ts[0].t(), lambda t: [t.t()]
    return ((f"{prefix}mlp.experts.gate_up_proj",), lambda ts: _gate_up_to_megatron(ts[0], etp),
            lambda t: [_gate_up_to_hf(t, etp)])


def _transposed(tensor):
    return tensor.transpose(-1, -2)


def in_memory_target(name: str, state_names: Any, hf_config: Any) -> tuple[str, Any] | None:
    """transformers keeps the fused experts transposed in memory ([E, 2I, H], [E, H, I]): a checkpoint-layout view."""
    if name.rpartition(".mlp.experts.")[2] not in FUSED_EXPERTS or name not in state_names:
        return None
    return name, _transposed


def check_config(hf_config: Any) -> None:
    """Fused expert tensors whose layout the shapes tell (module docstring), before Ray starts."""
    hidden, width = getattr(hf_config, "hidden_size", None), getattr(hf_config, "moe_intermediate_size", None)
    if not hidden or not width or hidden not in (width, 2 * width):
        return
    raise ValueError(f"hidden_size {hidden} and moe_intermediate_size {width} make the fused expert tensors square "
                     f"(gate_up_proj [E, {hidden}, {2 * width}], down_proj [E, {width}, {hidden}]): transformers reads "
                     "such a tensor untransposed and SGLang transposed, so their layout cannot be told; a checkpoint "
                     "of these sizes is not trained here")


def check_layout(hf_config: Any, args: Any) -> None:
    """The checkpoint's fused experts are in the released layout (not transformers' in-memory one), before Ray."""
    found = _first_fused_shape(args.hf_checkpoint) if args.hf_checkpoint else None
    if found is None or not getattr(hf_config, "hidden_size", None):
        return
    name, shape = found
    hidden = hf_config.hidden_size
    if shape[-2] != hidden:
        raise ValueError(f"{name} is stored {list(shape)}, transformers' in-memory layout [E, 2I, H] (as transformers "
                         f"5 saves it); Qwen's released layout, which SGLang and this trainer read, is [E, H, 2I] (and "
                         "down_proj [E, I, H]): write the checkpoint with the last two dimensions of every "
                         "mlp.experts.gate_up_proj and mlp.experts.down_proj transposed")


def _first_fused_shape(hf_dir: str) -> tuple[str, tuple[int, ...]] | None:
    """(name, shape) of the first layer's gate_up_proj from the safetensors headers; None if not found."""
    import json

    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        weight_map = None
    else:
        return None
    from safetensors import safe_open

    files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
    for file in files:
        with safe_open(os.path.join(hf_dir, file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(".mlp.experts.gate_up_proj"):
                    return name, tuple(f.get_slice(name).get_shape())
    return None


_NO_WINDOWS = ignored("transformers' Qwen3-VL-MoE text class sets sliding_window to None: every layer attends to "
                      "every earlier key (built)")
QWEN3_VL_MOE_FIELDS = table(
    QWEN3_FIELDS, QWEN_MOE_FIELDS,
    intermediate_size=built("the width of the dense MLPs of mlp_only_layers"),
    norm_topk_prob=ignored("transformers' Qwen3-VL-MoE router renormalises the top-k weights whatever it says (built "
                           "so)"),
    sliding_window=_NO_WINDOWS, use_sliding_window=_NO_WINDOWS, max_window_layers=_NO_WINDOWS, layer_types=_NO_WINDOWS,
)


def vision(hf_config: Any):
    return qwen_vision_arch(hf_config, "Qwen3-VL-MoE", interleaved=True, deepstack=True)


# The released configs leave text_config.tie_word_embeddings out (its class default is True) beside an untied outer
# one: transformers' composite class ties by the outer one, and so is the text model built
COMPOSITE_FIELDS = table(QWEN_VL_COMPOSITE_FIELDS, tie_word_embeddings=built(
    "lm_head tied to the text model's embed_tokens, as transformers' composite class ties them (whatever "
    "text_config.tie_word_embeddings says)"))

QWEN3_VL_MOE = register(ModelFamily(
    name="Qwen3-VL-MoE", model_types=("qwen3_vl_moe_text",), composite_types=("qwen3_vl_moe",),
    qk_layernorm=True, hf_fields=QWEN3_VL_MOE_FIELDS, composite_fields=COMPOSITE_FIELDS,
    experts_key="num_experts", moe_architecture=moe_architecture, moe_names=moe_names,
    stacked_experts=stacked_experts, in_memory_target=in_memory_target, check_config=check_config,
    check_layout=check_layout, vision=vision))
