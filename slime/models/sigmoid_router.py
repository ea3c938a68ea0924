"""The sigmoid-router MoE layers DeepSeek-V3 introduced and GLM-4.5, GLM-4.7-Flash and MiniMax-M2 share, as one
MoEArchitecture built from the facts each family's HF config spells its own way.

transformers' router (DeepseekV3TopkRouter, Glm4MoeTopkRouter, MiniMaxM2TopKRouter): sigmoid scores; the top-k
is chosen on scores + e_score_correction_bias, optionally limited to the best `topk_group` of `n_group` expert
groups (a group ranked by the sum of its two best biased scores); the chosen experts' unbiased scores are
renormalised over the k (`norm_topk_prob`) and scaled by `routed_scaling_factor`. megatron-core 0.16's router
(topk_routing_with_score_function) computes the same with moe_router_score_function="sigmoid", expert_bias,
moe_router_num_groups / moe_router_group_topk and moe_router_topk_scaling_factor, within the limits refused
here with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime.models.hf_fields import ROUTER_TRAINING, built, table
from slime.models.moe_arch import MoEArchitecture


@dataclass(frozen=True, kw_only=True)
class SigmoidRouterMoE:
    """The MoE facts of one HF config, in the family's own terms."""

    family: str
    """Shown in messages (e.g. "GLM-4.5 MoE")."""
    experts_key: str
    """The config.json key of the routed-expert count (named in messages)."""
    layer_pattern: tuple[int, ...]
    num_experts: int
    topk: int
    ffn_hidden_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0
    topk_scaling_factor: float = 1.0
    num_groups: int = 1
    group_topk: int = 1


def _refuse_unmatched(moe: SigmoidRouterMoE) -> None:
    """Settings megatron-core's router cannot reproduce exactly, or that transformers' cannot run."""
    name, experts, k = moe.family, moe.num_experts, moe.topk
    n_group, topk_group = moe.num_groups, moe.group_topk
    if moe.norm_topk_prob != (k > 1):
        raise ValueError(f"{name}: norm_topk_prob={moe.norm_topk_prob} with num_experts_per_tok={k}; megatron's "
                         "sigmoid router renormalises the top-k weights exactly when k > 1, so only norm_topk_prob = "
                         "(num_experts_per_tok > 1) can be matched")
    if n_group < 1 or experts % n_group or topk_group > n_group:
        raise ValueError(f"{name}: n_group={n_group}, topk_group={topk_group} with {moe.experts_key}={experts}; the "
                         "experts must split into n_group equal groups and topk_group <= n_group: set n_group to a "
                         f"divisor of {experts} and topk_group to at most n_group in config.json")
    if n_group == 1 and topk_group != 1:
        raise ValueError(f"{name}: topk_group={topk_group} with n_group=1; a single group has topk_group=1 "
                         "(set topk_group to 1)")
    if n_group > 1 and experts // n_group < 2:
        raise ValueError(f"{name}: n_group={n_group} leaves {experts // n_group} expert per group; transformers ranks a "
                         f"group by its two best scores, so each group needs at least 2: use n_group <= {experts // 2}")
    if n_group > 1 and topk_group < n_group and k // topk_group != 2:
        raise ValueError(f"{name}: n_group={n_group}, topk_group={topk_group}, num_experts_per_tok={k}: transformers "
                         "ranks a group by the sum of its top-2 scores, megatron-core by the sum of its "
                         f"top-(num_experts_per_tok // topk_group) = top-{k // topk_group}; they agree only when "
                         "num_experts_per_tok // topk_group == 2 (DeepSeek-V3: 8 // 4)")
    if k > experts:
        raise ValueError(f"{name}: num_experts_per_tok={k} is above {moe.experts_key}={experts}")


def sigmoid_router_architecture(moe: SigmoidRouterMoE, **hf_names: Any) -> MoEArchitecture:
    """The MoEArchitecture of a sigmoid-router MoE; `hf_names` are MoEArchitecture's hf_* spelling fields
    (default: DeepSeek-V3's, `shared_experts` for the ungated shared experts)."""
    _refuse_unmatched(moe)
    return MoEArchitecture(
        num_layers=len(moe.layer_pattern),
        num_experts=moe.num_experts,
        topk=moe.topk,
        ffn_hidden_size=moe.ffn_hidden_size,
        norm_topk_prob=moe.norm_topk_prob,
        layer_pattern=moe.layer_pattern,
        shared_expert_intermediate_size=moe.shared_expert_intermediate_size or None,
        shared_expert_gate=False,
        score_function="sigmoid",
        expert_bias=True,
        topk_scaling_factor=moe.topk_scaling_factor,
        num_groups=moe.num_groups,
        group_topk=moe.group_topk,
        **{"hf_shared_expert": "shared_experts", **hf_names},
    )


DEEPSEEK_STYLE_MOE_FIELDS = table(
    ROUTER_TRAINING,
    n_routed_experts=built("the routed experts"),
    num_experts_per_tok=built("the router's top-k"),
    moe_intermediate_size=built("each routed expert's width"),
    n_shared_experts=built("the ungated shared experts (n_shared_experts x moe_intermediate_size wide)"),
    routed_scaling_factor=built("moe_router_topk_scaling_factor"),
    n_group=built("moe_router_num_groups (group-limited top-k; settings megatron cannot match are refused)"),
    topk_group=built("moe_router_group_topk"),
    norm_topk_prob=built("the top-k weights renormalised (refused unless it is num_experts_per_tok > 1)"),
    first_k_dense_replace=built("the dense layers before the MoE layers"),
)
"""The expert and router fields spelt as DeepSeek-V3 spells them (DeepSeek-V3, Kimi-K2, GLM-4.5, GLM-4.7-Flash,
GLM-5); the router itself is deepseek_style_moe's."""


def first_k_dense(hf_config: Any) -> tuple[int, ...]:
    """Layer pattern of `first_k_dense_replace` dense layers, then MoE layers (DeepSeek-V3, GLM-4.5)."""
    layers = hf_config.num_hidden_layers
    dense = getattr(hf_config, "first_k_dense_replace", None)
    dense = layers if dense is None else dense
    return tuple(int(i >= dense) for i in range(layers))


def dense_or_sparse_layers(hf_config: Any, family: str) -> tuple[int, ...]:
    """Layer pattern of `mlp_layer_types` ("dense" or "sparse" per layer: GLM-4.7-Flash, GLM-5, DeepSeek-V3.2);
    ValueError naming the family when it does not give one of them for each layer."""
    kinds = list(getattr(hf_config, "mlp_layer_types", None) or ())
    if len(kinds) != hf_config.num_hidden_layers or set(kinds) - {"dense", "sparse"}:
        raise ValueError(f"{family}: mlp_layer_types {kinds} must give 'dense' or 'sparse' for each of the "
                         f"{hf_config.num_hidden_layers} layers; fix config.json")
    return tuple(int(kind == "sparse") for kind in kinds)


def deepseek_style_moe(hf_config: Any, family: str, layer_pattern: tuple[int, ...]) -> SigmoidRouterMoE:
    """The facts of a config spelt as DeepSeek-V3's (n_routed_experts, moe_intermediate_size, n_shared_experts,
    routed_scaling_factor, n_group, topk_group, norm_topk_prob): DeepSeek-V3, Kimi-K2, GLM-4.5, GLM-4.7-Flash."""
    topk = hf_config.num_experts_per_tok
    return SigmoidRouterMoE(
        family=family,
        experts_key="n_routed_experts",
        layer_pattern=layer_pattern,
        num_experts=hf_config.n_routed_experts,
        topk=topk,
        ffn_hidden_size=hf_config.moe_intermediate_size,
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", True)),
        shared_expert_intermediate_size=int(getattr(hf_config, "n_shared_experts", None) or 0)
        * hf_config.moe_intermediate_size,
        topk_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", None) or 1.0),
        num_groups=int(getattr(hf_config, "n_group", None) or 1),
        group_topk=int(getattr(hf_config, "topk_group", None) or 1),
    )
