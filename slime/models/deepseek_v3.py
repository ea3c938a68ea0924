"""DeepSeek-V3 family (transformers' DeepseekV3ForCausalLM; DeepSeek-V2 and Kimi-K2 share its attention):
multi-latent attention on megatron-core, registered as one ModelFamily (`DEEPSEEK_V3`, at the end).

What lives here, so the builder, load, save-hf and the weight push read one description:
- `mla_config_fields(hf_config)`: the MLATransformerConfig fields of the HF config (latent ranks, head
  dims, RoPE or YaRN with its mscale terms);
- `mla_layer_spec(config)`: megatron's local MLA layer spec with this project's SP-capable norms and
  CP/THD-capable core attention (q/k heads of qk_head_dim + qk_pos_emb_head_dim, v heads of v_head_dim);
- `attention_names(prefix)`: HF <-> megatron names of the attention parameters. megatron's MLA keeps
  HF's layouts (per head [nope | rope] rows in q_b_proj, [nope | v] rows in kv_b_proj, [latent | rope]
  rows in kv_a_proj_with_mqa), and both sides de-interleave the rotary dimensions at run time, so every
  tensor maps one to one; TP splits are whole rows (generic in hf_weights);
- `moe_architecture(hf_config)`: the MoE layers (first_k_dense_replace dense layers, then routed experts
  behind a sigmoid router with e_score_correction_bias, group-limited top-k, routed_scaling_factor and
  n_shared_experts ungated shared experts), refusing what megatron-core 0.16's router cannot match exactly.
  Their names are the Qwen-MoE ones (moe_hf.moe_hf_names) with `shared_experts` for the shared expert.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from slime.models.hf_fields import CONFIG_OBJECT, DECODER, built, checked, ignored, must_be, table
from slime.models.mtp import after_decoder_names
from slime.models.registry import ModelFamily, register
from slime.models.sigmoid_router import DEEPSEEK_STYLE_MOE_FIELDS, deepseek_style_moe, first_k_dense, \
    sigmoid_router_architecture

MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")
# DeepseekV3ForCausalLM's MoE layout (Kimi-K2 ships the same architecture)
MOE_MODEL_TYPES = ("deepseek_v3", "kimi_k2")


def is_mla(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", "") in MLA_MODEL_TYPES


def mla_arch_overrides(hf_config: Any) -> dict[str, Any]:
    """The dense architecture fields MLA sets otherwise: one kv head per query head, q/k heads of
    qk_nope_head_dim + qk_rope_head_dim."""
    return dict(num_query_groups=hf_config.num_attention_heads,
                kv_channels=hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim)


def _rope_params(hf_config: Any) -> dict[str, Any]:
    return dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})


def mla_config_fields(hf_config: Any) -> dict[str, Any]:
    """MLATransformerConfig fields of a DeepSeek-V3-style HF config."""
    rope = _rope_params(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"MLA supports default or yarn RoPE, got {rope_type!r}")
    fields = dict(
        multi_latent_attention=True,
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        rotary_base=float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
        rope_type="rope",
        rotary_scaling_factor=1.0,
        mscale=1.0,
        mscale_all_dim=0.0,
    )
    if rope_type == "yarn":
        fields.update(
            rope_type="yarn",
            rotary_scaling_factor=float(rope["factor"]),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 4096)),
            beta_fast=float(rope.get("beta_fast", 32)),
            beta_slow=float(rope.get("beta_slow", 1)),
            mscale=float(rope.get("mscale", 1.0)),
            mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
        )
    return fields


def _one_kv_head_per_query_head(value: Any, hf_config: Any) -> str | None:
    if value is None or value == hf_config.num_attention_heads:
        return None
    return (f"latent attention has one key/value head per query head (num_attention_heads = "
            f"{hf_config.num_attention_heads}); set num_key_value_heads to it")


MLA_FIELDS = table(
    CONFIG_OBJECT, DECODER,
    num_key_value_heads=checked("num_attention_heads: multi-latent attention has a key and a value per query head",
                                _one_kv_head_per_query_head, 1),
    head_dim=built("the RoPE width, qk_rope_head_dim (transformers derives it)"),
    q_lora_rank=built("the query compression (none: a full q_proj)"),
    kv_lora_rank=built("the key/value latent"),
    qk_nope_head_dim=built("qk_head_dim"),
    qk_rope_head_dim=built("qk_pos_emb_head_dim"),
    qk_head_dim=built("qk_nope_head_dim + qk_rope_head_dim (transformers derives it)"),
    v_head_dim=built("v_head_dim"),
    rope_interleave=checked("interleaved rope dimensions, de-interleaved at run time as transformers does",
                            must_be(True, "megatron's MLA de-interleaves the rope dimensions"), False),
    attention_bias=checked("no bias on the MLA projections", must_be(False, "bias on the MLA projections"), True),
    mlp_bias=checked("no bias on the MLP projections", must_be(False, "bias on the MLP projections"), True),
    num_nextn_predict_layers=built("the MTP layers (--mtp-num-layers must agree)"),
)
"""Multi-latent attention's fields (DeepSeek-V3, Kimi-K2, DeepSeek-V2, GLM-4.7-Flash, GLM-5)."""

DEEPSEEK_V3_FIELDS = table(
    MLA_FIELDS, DEEPSEEK_STYLE_MOE_FIELDS,
    topk_method=built("the router: only noaux_tc (the sigmoid router with the score correction bias) is mapped; "
                      "MoE layers with another are refused"),
    scoring_func=built("the router's scores: sigmoid only (MoE layers with another are refused)"),
    moe_layer_freq=built("refused unless 1: transformers' class makes every layer from first_k_dense_replace an MoE "
                         "layer"),
    ep_size=ignored("the expert split of DeepSeek's own inference code; --expert-model-parallel-size sets the "
                    "trainer's"),
    aux_loss_alpha=ignored("the load-balancing loss of DeepSeek's own training; --moe-aux-loss-coeff sets the "
                           "trainer's"),
    seq_aux=ignored("the load-balancing loss of DeepSeek's own training; --moe-aux-loss-coeff sets the trainer's"),
)


# Megatron flag dest -> MLA config field: a flag the user passed must agree with the HF config.
MLA_FLAGS = {
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_head_dim": "qk_head_dim",
    "qk_pos_emb_head_dim": "qk_pos_emb_head_dim", "v_head_dim": "v_head_dim",
    "rotary_scaling_factor": "rotary_scaling_factor", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim",
}


def _full_latent_forward(linear: Any, config: Any):
    """forward of linear_kv_down_proj (a ColumnParallelLinear) giving the full [latent | rope] width.

    megatron-core 0.16's local MLA gathers the TP-split down projection and uses its rope columns in every
    TP rank's heads, but leaves their gradient partial (each rank's heads only): the RoPE key's weight rows,
    the input norm and everything below get a wrong gradient at TP > 1 (the loss is right, the grad norm
    is not). Returned full-width, MLA takes its replicated-output branch; here the rope columns' gradient
    is summed over TP (without SP; with SP MLA's own sequence gather reduce-scatters it).
    """
    from megatron.core.tensor_parallel.mappings import (
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    import torch

    column_forward = linear.forward
    sum_grad_over_tp = _SUM_GRAD_OVER_TP()

    def forward(hidden_states, *args, **kwargs):
        local, bias = column_forward(hidden_states, *args, **kwargs)
        full = gather_from_tensor_model_parallel_region(local)
        if config.sequence_parallel:
            return scatter_to_sequence_parallel_region(full), bias
        latent, rope = full.split([config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1)
        return torch.cat([latent, sum_grad_over_tp.apply(rope)], dim=-1), bias

    return forward


def _sum_grad_over_tp_class():
    import torch

    class _SumGradOverTP(torch.autograd.Function):
        """Identity forward; backward all-reduces the gradient over the TP group. (megatron's
        copy_to_tensor_model_parallel_region reduces a contiguous copy of a non-contiguous gradient, such as
        this slice's, and returns the unreduced original.)"""

        @staticmethod
        def forward(ctx, tensor):
            return tensor

        @staticmethod
        def backward(ctx, grad):
            from megatron.core import parallel_state

            grad = grad.contiguous()
            torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
            return grad

    return _SumGradOverTP


# a class per process, made on first use (torch is imported only once a model is built)
_SUM_GRAD_OVER_TP = functools.cache(_sum_grad_over_tp_class)


def _mla_attention_class():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class LatentSelfAttention(MLASelfAttention):
        """megatron's MLASelfAttention with the TP gradient of the RoPE key made whole (_full_latent_forward)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if type(self.linear_kv_down_proj) is ColumnParallelLinear and self.config.tensor_model_parallel_size > 1:
                # an instance attribute: parameter names (checkpoints, HF mapping) stay megatron's
                self.linear_kv_down_proj.forward = _full_latent_forward(self.linear_kv_down_proj, self.config)

    return LatentSelfAttention


_LATENT_ATTENTION = functools.cache(_mla_attention_class)


def mla_layer_spec(config: Any, mlp: Any = None):
    """megatron's local MLA layer spec with SP-capable norms and CP/THD-capable core attention; `mlp`
    replaces the dense MLP spec (an MoE layer's)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from slime.models.cp_attention import ContextParallelAttention
    from slime.models.sp_norm import SequenceParallelNorm

    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    sub = spec.submodules
    attention = sub.self_attention
    attn_sub = dataclasses.replace(attention.submodules, core_attention=ContextParallelAttention,
                                   q_layernorm=SequenceParallelNorm, kv_layernorm=SequenceParallelNorm)
    sub = dataclasses.replace(sub, input_layernorm=SequenceParallelNorm, pre_mlp_layernorm=SequenceParallelNorm,
                              self_attention=dataclasses.replace(attention, module=_LATENT_ATTENTION(),
                                                                 submodules=attn_sub),
                              mlp=sub.mlp if mlp is None else mlp)
    return dataclasses.replace(spec, submodules=sub)


def attention_names(prefix: str) -> dict[str, str]:
    """megatron MLA parameter suffix -> HF name (local-spec and TE-spec spellings)."""
    attn = f"{prefix}self_attn."
    return {
        "self_attention.linear_q_proj.weight": f"{attn}q_proj.weight",
        "self_attention.linear_q_down_proj.weight": f"{attn}q_a_proj.weight",
        "self_attention.q_layernorm.weight": f"{attn}q_a_layernorm.weight",
        "self_attention.linear_q_up_proj.layer_norm_weight": f"{attn}q_a_layernorm.weight",
        "self_attention.linear_q_up_proj.weight": f"{attn}q_b_proj.weight",
        "self_attention.linear_kv_down_proj.weight": f"{attn}kv_a_proj_with_mqa.weight",
        "self_attention.kv_layernorm.weight": f"{attn}kv_a_layernorm.weight",
        "self_attention.linear_kv_up_proj.layer_norm_weight": f"{attn}kv_a_layernorm.weight",
        "self_attention.linear_kv_up_proj.weight": f"{attn}kv_b_proj.weight",
        "self_attention.linear_proj.weight": f"{attn}o_proj.weight",
    }


# ------------------------------------------------------------------ the MoE layers


def _has_moe_layers(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "n_routed_experts", None)) and 1 in first_k_dense(hf_config)


def _refuse_unmatched_router(hf_config: Any) -> None:
    """DeepSeek-V3 config settings outside the sigmoid router that megatron-core 0.16 reproduces (the rest of
    the router's limits are sigmoid_router's)."""
    scoring = getattr(hf_config, "scoring_func", "sigmoid")
    method = getattr(hf_config, "topk_method", "noaux_tc")
    if scoring != "sigmoid" or method not in (None, "noaux_tc"):
        raise ValueError(f"DeepSeek-V3 MoE: scoring_func={scoring!r}, topk_method={method!r}; only the sigmoid "
                         "router with e_score_correction_bias (noaux_tc) is mapped onto megatron's")
    if (getattr(hf_config, "moe_layer_freq", 1) or 1) != 1:
        raise ValueError(f"DeepSeek-V3 MoE: moe_layer_freq={hf_config.moe_layer_freq}; transformers' "
                         "DeepseekV3ForCausalLM makes every layer from first_k_dense_replace on an MoE layer, so "
                         "only moe_layer_freq=1 means the same model on both sides")


def moe_architecture(hf_config: Any):
    """The MoE facts of a DeepSeek-V3-style config (None when every layer is dense).

    HF -> megatron: sigmoid scores, + e_score_correction_bias for the choice only (megatron's expert_bias),
    group-limited top-k (n_group / topk_group -> moe_router_num_groups / moe_router_group_topk), weights
    renormalised over the k then scaled by routed_scaling_factor (moe_router_topk_scaling_factor), and
    n_shared_experts * moe_intermediate_size wide shared experts added without a gate (sigmoid_router.py).
    """
    if not _has_moe_layers(hf_config):
        return None
    model_type = getattr(hf_config, "model_type", "")
    if model_type not in MOE_MODEL_TYPES:
        raise ValueError(f"{model_type} MoE layers (a softmax router with topk_method "
                         f"{getattr(hf_config, 'topk_method', None)!r}) are not mapped; only DeepSeek-V3's sigmoid "
                         "router is: use a deepseek_v3 checkpoint or one whose layers are all dense")
    _refuse_unmatched_router(hf_config)
    return sigmoid_router_architecture(deepseek_style_moe(hf_config, "DeepSeek-V3 MoE", first_k_dense(hf_config)))


# ------------------------------------------------------------------ the family

# Kimi-K2 ships DeepSeek-V3's architecture; DeepSeek-V2's attention is the same MLA, its MoE layers (a softmax
# router) are refused by moe_architecture.
DEEPSEEK_V3 = register(ModelFamily(
    name="DeepSeek-V3",
    model_types=MLA_MODEL_TYPES,
    hf_config_types={"kimi_k2": "deepseek_v3"},  # Kimi-K2 ships DeepSeek-V3's config class as remote code
    hf_fields=DEEPSEEK_V3_FIELDS,
    experts_key="n_routed_experts",
    qk_layernorm=True,  # the latent q/kv norms are megatron's qk_layernorm
    rope_types=None,  # mla_config_fields reads default or YaRN RoPE
    arch_overrides=mla_arch_overrides,
    config_fields=mla_config_fields,
    config_flags=MLA_FLAGS,
    layer_spec=mla_layer_spec,
    moe_architecture=moe_architecture,
    layer_names=attention_names,
    mtp_names=after_decoder_names,
))
