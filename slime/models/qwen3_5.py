"""Qwen3.5 and Qwen3-Next (transformers' Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM): hybrid
stacks of gated DeltaNet (linear attention) and gated full-attention layers, dense or MoE; the families
(`QWEN3_5`, `QWEN3_NEXT`, at the end).

- `layer_types` says each layer's token mixer: "linear_attention" (slime/models/gated_deltanet.py in the
  self-attention slot) or "full_attention" (megatron's SelfAttention with the attention output gate: HF q_proj
  holds [q_h; gate_h] per head, o_proj reads attention * sigmoid(gate); q/k RMSNorm; partial RoPE from
  partial_rotary_factor).
- Every RMSNorm but the DeltaNet's gated one is zero-centred (scale 1 + weight): layernorm_zero_centered_gamma.
- MoE (qwen3_next, qwen3_5_moe_text): softmax top-k router, renormalised, and one shared expert behind a
  sigmoid gate (HF shared_expert_gate); Qwen3.5-MoE routes every layer, Qwen3-Next as Qwen2-MoE does.
- HF DeltaNet projections: Qwen3.5 has in_proj_qkv ([q all | k all | v all]), in_proj_z, in_proj_b, in_proj_a;
  Qwen3-Next fuses them per key head j: in_proj_qkvz [q_j | k_j | v_j | z_j], in_proj_ba [b_j | a_j]. Both map
  to the megatron in_proj grouped per key head (gated_deltanet.py); conv1d channels [q | k | v] to per group.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from slime.models.hf_fields import ATTENTION_BIAS, CONFIG_OBJECT, DECODER, built, checked, ignored, table
from slime.models.moe_arch import MoEArchitecture
from slime.models.mtp import qwen3_next_names
from slime.models.qwen3_moe import QWEN_MOE_FIELDS
from slime.models.qwen3_moe import moe_architecture as qwen_moe_architecture
from slime.models.registry import ModelFamily, register
from slime.models.vision_arch import QWEN_VL_COMPOSITE_FIELDS

LAYER_KINDS = ("linear_attention", "full_attention")


def layer_kinds(hf_config: Any) -> tuple[str, ...]:
    """The token mixer of every layer (config.layer_types), checked."""
    kinds = tuple(getattr(hf_config, "layer_types", None) or ())
    if len(kinds) != hf_config.num_hidden_layers:
        raise ValueError(f"config.json layer_types lists {len(kinds)} layers, num_hidden_layers is "
                         f"{hf_config.num_hidden_layers}; give one of {LAYER_KINDS} per layer")
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"config.json layer_types has {unknown}, which no layer here builds; the supported kinds "
                         f"are {LAYER_KINDS}")
    return kinds


def kind_layer_spec(config: Any, kind: str):
    """The local spec of a dense layer of this kind: the gated DeltaNet or the (gated) full attention."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    from slime.models.gated_deltanet import GatedDeltaNet
    from slime.models.local_spec import dense_layer_spec

    spec = dense_layer_spec(config)
    if kind == "full_attention":
        return spec
    sub = dataclasses.replace(spec.submodules, self_attention=ModuleSpec(module=GatedDeltaNet))
    return dataclasses.replace(spec, submodules=sub)


def get_qwen3_5_spec(args: Any, config: Any, vp_stage: int | None = None):
    """Upstream's `--spec` plug-in signature (what `slime_plugins.models.qwen3_5 get_qwen3_5_spec` and the
    Qwen3-Next one name): this pipeline stage's layers, each by its kind in config.linear_attention_freq and with
    megatron's MoE layer where config.moe_layer_freq says so, and the project's final norm; the same layers the
    builder makes from the family without --spec."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from slime.models.grouped_experts import grouped_experts_chosen
    from slime.models.local_spec import with_moe_mlp
    from slime.models.sp_norm import SequenceParallelNorm

    grouped = grouped_experts_chosen(args.moe_grouped_gemm)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    specs = []
    for layer in range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage)):
        spec = kind_layer_spec(config, LAYER_KINDS[0] if config.linear_attention_freq[layer] else LAYER_KINDS[1])
        if config.num_moe_experts and config.moe_layer_freq[layer]:
            spec = with_moe_mlp(spec, config, grouped)
        specs.append(spec)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=SequenceParallelNorm)


# upstream's Qwen3-Next plug-in name: the same hybrid stack
get_qwen3_next_spec = get_qwen3_5_spec


def get_qwen3_5_vl_model_provider(args: Any, config: Any, vp_stage: int | None = None):
    """Upstream's Qwen3.5-VL plug-in name: the text model's layers (those of get_qwen3_5_spec). The vision tower is
    put in front by the builder when the run trains on images (--multimodal-keys; slime/models/vision_language.py),
    as upstream's provider does."""
    return get_qwen3_5_spec(args, config, vp_stage)


def vision_arch(hf_config: Any):
    """Qwen3.5's vision side: interleaved multimodal RoPE over the rotated half of each head, no deepstack."""
    from slime.models.vision_arch import qwen_vision_arch

    return qwen_vision_arch(hf_config, "Qwen3.5", interleaved=True)


def config_fields(hf_config: Any) -> dict[str, Any]:
    """The DeltaNet sizes in megatron-core's TransformerConfig fields (its linear_attention_freq: 1 = DeltaNet)."""
    return dict(
        linear_conv_kernel_dim=hf_config.linear_conv_kernel_dim,
        linear_key_head_dim=hf_config.linear_key_head_dim,
        linear_value_head_dim=hf_config.linear_value_head_dim,
        linear_num_key_heads=hf_config.linear_num_key_heads,
        linear_num_value_heads=hf_config.linear_num_value_heads,
        linear_attention_freq=[int(kind == "linear_attention") for kind in layer_kinds(hf_config)],
    )


# megatron flag dest -> config_fields key: upstream's DeltaNet size flags must agree with the HF config
CONFIG_FLAGS = MappingProxyType({name: name for name in (
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads")})


def arch_overrides(hf_config: Any) -> dict[str, Any]:
    # Qwen3.5-MoE has no dense MLP (every layer routes): the dense width is unused, the experts' is given
    if getattr(hf_config, "intermediate_size", None) is None:
        return dict(ffn_hidden_size=hf_config.moe_intermediate_size)
    return {}


def moe_architecture(hf_config: Any) -> MoEArchitecture | None:
    """Qwen-MoE's routed experts and gated shared expert: every layer (Qwen3.5-MoE, whose config has no
    norm_topk_prob and always renormalises), or as decoder_sparse_step and mlp_only_layers say (Qwen3-Next)."""
    return qwen_moe_architecture(hf_config, renormalise_by_default=True)


def layer_names(prefix: str) -> dict[str, str]:
    """megatron suffix -> HF name of the DeltaNet parameters kept as they are."""
    attn = f"{prefix}linear_attn."
    return {
        "self_attention.A_log": f"{attn}A_log",
        "self_attention.dt_bias": f"{attn}dt_bias",
        "self_attention.norm_weight": f"{attn}norm.weight",
        "self_attention.out_proj.weight": f"{attn}out_proj.weight",
    }


# ---------------------------------------------------------------- DeltaNet layouts (pure torch, no megatron)
def _sizes(hf_config: Any) -> tuple[int, int, int, int]:
    """(key heads, key head dim, value head dim, value heads per key head)."""
    nk = hf_config.linear_num_key_heads
    return nk, hf_config.linear_key_head_dim, hf_config.linear_value_head_dim, hf_config.linear_num_value_heads // nk


def _conv_layout(hf_config: Any) -> tuple:
    """HF conv1d channels [q all | k all | v all] <-> megatron's per key head [q_j | k_j | v_j]."""
    import torch

    nk, dk, dv, r = _sizes(hf_config)

    def to_megatron(ts):
        q, k, v = ts[0].split([nk * dk, nk * dk, nk * r * dv])
        rest = q.shape[1:]
        return torch.cat([q.reshape(nk, dk, *rest), k.reshape(nk, dk, *rest), v.reshape(nk, r * dv, *rest)],
                         dim=1).reshape(-1, *rest)

    def to_hf(t):
        rest = t.shape[1:]
        q, k, v = t.reshape(nk, 2 * dk + r * dv, *rest).split([dk, dk, r * dv], dim=1)
        return [torch.cat([x.reshape(-1, *rest) for x in (q, k, v)])]

    return to_megatron, to_hf


def _split_in_proj(hf_config: Any) -> tuple:
    """Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a <-> megatron's in_proj grouped per key head."""
    import torch

    nk, dk, dv, r = _sizes(hf_config)
    conv_to_megatron, conv_to_hf = _conv_layout(hf_config)

    def to_megatron(ts):
        qkv, z, b, a = ts
        rest = qkv.shape[1:]
        per_group = [conv_to_megatron([qkv]).reshape(nk, -1, *rest)]
        per_group += [x.reshape(nk, -1, *rest) for x in (z, b, a)]
        return torch.cat(per_group, dim=1).reshape(-1, *rest)

    def to_hf(t):
        rest = t.shape[1:]
        mixed, z, b, a = t.reshape(nk, -1, *rest).split([2 * dk + r * dv, r * dv, r, r], dim=1)
        return [*conv_to_hf(mixed.reshape(-1, *rest)), *(x.reshape(-1, *rest) for x in (z, b, a))]

    return to_megatron, to_hf


def _fused_in_proj(hf_config: Any) -> tuple:
    """Qwen3-Next's in_proj_qkvz, in_proj_ba (already per key head) <-> megatron's in_proj: [qkvz_j | ba_j]."""
    import torch

    nk, dk, dv, r = _sizes(hf_config)
    width = 2 * dk + 2 * r * dv

    def to_megatron(ts):
        qkvz, ba = ts
        rest = qkvz.shape[1:]
        return torch.cat([qkvz.reshape(nk, width, *rest), ba.reshape(nk, 2 * r, *rest)], dim=1).reshape(-1, *rest)

    def to_hf(t):
        rest = t.shape[1:]
        qkvz, ba = t.reshape(nk, width + 2 * r, *rest).split([width, 2 * r], dim=1)
        return [qkvz.reshape(-1, *rest), ba.reshape(-1, *rest)]

    return to_megatron, to_hf


def _layouts(fused: bool):
    def layer_layouts(prefix: str, hf_config: Any) -> dict[str, tuple]:
        attn = f"{prefix}linear_attn."
        if fused:
            in_names = (f"{attn}in_proj_qkvz.weight", f"{attn}in_proj_ba.weight")
            in_proj = _fused_in_proj(hf_config)
        else:
            in_names = tuple(f"{attn}in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))
            in_proj = _split_in_proj(hf_config)
        return {"self_attention.in_proj.weight": (in_names, *in_proj),
                "self_attention.conv1d_weight": ((f"{attn}conv1d.weight",), *_conv_layout(hf_config))}

    return layer_layouts


HYBRID_FIELDS = table(
    CONFIG_OBJECT, DECODER, ATTENTION_BIAS, QWEN_MOE_FIELDS,
    intermediate_size=built("ffn_hidden_size of the dense MLPs (Qwen3.5-MoE has none: the experts' width)"),
    layer_types=built("each layer's token mixer: linear_attention (the gated DeltaNet) or full_attention"),
    linear_conv_kernel_dim=built("the DeltaNet's causal convolution width"),
    linear_key_head_dim=built("the DeltaNet's key head dim"),
    linear_value_head_dim=built("the DeltaNet's value head dim"),
    linear_num_key_heads=built("the DeltaNet's key heads"),
    linear_num_value_heads=built("the DeltaNet's value heads"),
    mtp_num_hidden_layers=built("the MTP layers (--mtp-num-layers must agree)"),
)
"""Qwen3.5's and Qwen3-Next's text config: the hybrid stack, dense or MoE (Qwen3.5-MoE always renormalises)."""


COMPOSITE_FIELDS = QWEN_VL_COMPOSITE_FIELDS
"""The vision + text wrapper of the released Qwen3.5 checkpoints (qwen3_5, qwen3_5_moe)."""

_COMMON = dict(hf_fields=HYBRID_FIELDS, experts_key="num_experts", qk_layernorm=True, attention_output_gate=True, zero_centered_norms=True, layer_kinds=layer_kinds,
               kind_layer_spec=kind_layer_spec, config_fields=config_fields, config_flags=CONFIG_FLAGS,
               arch_overrides=arch_overrides, moe_architecture=moe_architecture, layer_names=layer_names)

# the released Qwen3.5 checkpoints are composite (Qwen3_5ForConditionalGeneration): the vision tower is trained
# with the text model on images, else carried through
QWEN3_5 = register(ModelFamily(name="Qwen3.5", model_types=("qwen3_5_text", "qwen3_5_moe_text"),
                               composite_types=("qwen3_5", "qwen3_5_moe"), composite_fields=COMPOSITE_FIELDS,
                               vision=vision_arch,
                               layer_layouts=_layouts(fused=False),
                               spec_plugins=("slime_plugins.models.qwen3_5 get_qwen3_5_spec",
                                             "slime_plugins.models.qwen3_5_vl get_qwen3_5_vl_model_provider"),
                               **_COMMON))
QWEN3_NEXT = register(ModelFamily(name="Qwen3-Next", model_types=("qwen3_next",), layer_layouts=_layouts(fused=True),
                                  mtp_names=qwen3_next_names,
                                  spec_plugins=("slime_plugins.models.qwen3_next get_qwen3_next_spec",), **_COMMON))
