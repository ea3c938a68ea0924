"""GLM-4.5 / GLM-4.6 (transformers' Glm4MoeForCausalLM) and GLM-4.7-Flash (Glm4MoeLiteForCausalLM): two
families, registered at the end, that share the DeepSeek-V3 MoE layers (sigmoid_router.py).

GLM-4.5 (`glm4_moe`): a Llama-style GQA layer with bias on q/k/v only (`attention_bias`; o_proj has none),
an optional per-head RMSNorm of q and k (`use_qk_norm`: megatron's qk_layernorm, HF q_norm / k_norm), RoPE on
the first `partial_rotary_factor` (0.5) of each head's dimensions in two halves (not interleaved, unlike
GLM-4's), and no post norms. Layers from `first_k_dense_replace` on are MoE layers.

GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's multi-latent attention (deepseek_v3.py maps it; the same HF
module names) with that MoE; its dense / MoE layers are listed per layer (`mlp_layer_types`).

Both spell the MoE block as DeepSeek-V3 does (mlp.gate.weight, mlp.gate.e_score_correction_bias,
mlp.experts.E.{gate,up,down}_proj, mlp.shared_experts.*).
"""

from __future__ import annotations

from typing import Any

from slime.models.deepseek_v3 import MLA_FIELDS, MLA_FLAGS, attention_names, mla_arch_overrides, mla_config_fields, \
    mla_layer_spec
from slime.models.hf_fields import CONFIG_OBJECT, DECODER, built, ignored, table
from slime.models.mtp import after_decoder_names
from slime.models.registry import ModelFamily, register
from slime.models.sigmoid_router import DEEPSEEK_STYLE_MOE_FIELDS, deepseek_style_moe, dense_or_sparse_layers, \
    first_k_dense, sigmoid_router_architecture


def _has_experts(hf_config: Any, pattern: tuple[int, ...]) -> bool:
    return bool(getattr(hf_config, "n_routed_experts", None)) and 1 in pattern


# ------------------------------------------------------------------ GLM-4.5


def glm4_moe_arch_overrides(hf_config: Any) -> dict[str, Any]:
    """q/k/v biases and the q/k norms as the config says (both optional in Glm4MoeConfig)."""
    return dict(add_qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
                qk_layernorm=bool(getattr(hf_config, "use_qk_norm", False)))


def glm4_moe_architecture(hf_config: Any):
    """GLM-4.5's MoE layers: first_k_dense_replace dense layers, then DeepSeek-V3's sigmoid-router MoE."""
    pattern = first_k_dense(hf_config)
    if not _has_experts(hf_config, pattern):
        return None
    return sigmoid_router_architecture(deepseek_style_moe(hf_config, "GLM-4.5 MoE", pattern))


GLM4_MOE_FIELDS = table(
    CONFIG_OBJECT, DECODER, DEEPSEEK_STYLE_MOE_FIELDS,
    attention_bias=built("the q/k/v projections' bias (o_proj has none)"),
    use_qk_norm=built("qk_layernorm (HF q_norm / k_norm per head)"),
    num_nextn_predict_layers=built("the MTP layers (--mtp-num-layers must agree)"),
)

GLM4_MOE = register(ModelFamily(
    name="GLM-4.5",
    model_types=("glm4_moe",),
    hf_fields=GLM4_MOE_FIELDS,
    experts_key="n_routed_experts",
    qkv_bias=True,  # on q/k/v only, when attention_bias (glm4_moe_arch_overrides)
    arch_overrides=glm4_moe_arch_overrides,
    moe_architecture=glm4_moe_architecture,
    mtp_names=after_decoder_names,
))


# ------------------------------------------------------------------ GLM-4.7-Flash


def glm4_moe_lite_architecture(hf_config: Any):
    """GLM-4.7-Flash's MoE layers: those `mlp_layer_types` calls sparse, with DeepSeek-V3's router."""
    pattern = dense_or_sparse_layers(hf_config, "GLM-4.7-Flash")
    if not _has_experts(hf_config, pattern):
        return None
    return sigmoid_router_architecture(deepseek_style_moe(hf_config, "GLM-4.7-Flash MoE", pattern))


def glm4_moe_lite_config_fields(hf_config: Any) -> dict[str, Any]:
    """DeepSeek-V3's MLA fields; the RoPE must be what deepseek_v3's mapping reproduces (full rotary width of the
    rope head dims; interleaved pairs, rope_interleave, is MLA_FIELDS' check)."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    partial = float(rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise ValueError(f"GLM-4.7-Flash: partial_rotary_factor={partial} on the qk_rope_head_dim dimensions is not "
                         "mapped (megatron's MLA rotates all of them); use a config with partial_rotary_factor 1.0")
    return mla_config_fields(hf_config)


GLM4_MOE_LITE_FIELDS = table(
    MLA_FIELDS, DEEPSEEK_STYLE_MOE_FIELDS,
    mlp_layer_types=built("each layer's MLP: dense or sparse (the MoE layer pattern)"),
    first_k_dense_replace=ignored("transformers' GLM-4.7-Flash class reads mlp_layer_types instead (built)"),
)

GLM4_MOE_LITE = register(ModelFamily(
    name="GLM-4.7-Flash",
    model_types=("glm4_moe_lite",),
    hf_fields=GLM4_MOE_LITE_FIELDS,
    experts_key="n_routed_experts",
    qk_layernorm=True,  # the latent q/kv norms are megatron's qk_layernorm
    rope_types=None,  # mla_config_fields reads default or YaRN RoPE
    arch_overrides=mla_arch_overrides,
    config_fields=glm4_moe_lite_config_fields,
    config_flags=MLA_FLAGS,
    layer_spec=mla_layer_spec,
    moe_architecture=glm4_moe_lite_architecture,
    layer_names=attention_names,
    mtp_names=after_decoder_names,
))
