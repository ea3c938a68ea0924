"""Qwen3-MoE and Qwen2-MoE (transformers' Qwen3MoeForCausalLM, Qwen2MoeForCausalLM): the two families and what
their HF config says about the experts.

Qwen3-MoE is Qwen3's attention (q/k norms) with MoE layers: a softmax router over `num_experts`, top
`num_experts_per_tok`, renormalised when `norm_topk_prob`; every `decoder_sparse_step`-th layer is an MoE layer
except those in `mlp_only_layers`. Qwen2-MoE is Qwen2's attention (q/k/v biases) with the same layers plus a
shared expert behind a sigmoid gate. The HF <-> megatron names of the MoE parameters are the shared ones
(moe_hf.py); they are re-exported here under their earlier path.
"""

from __future__ import annotations

from typing import Any

from slime.models.hf_arch import sliding_windows
from slime.models.hf_fields import ROUTER_TRAINING, SLIDING_WINDOW, built, ignored, table
from slime.models.moe_arch import MoEArchitecture
# the shared MoE names and routes lived here first; imports by this path keep working
from slime.models.moe_hf import (  # noqa: F401
    RouteCapture,
    checkpoint_expert_count,
    decode_routes,
    encode_routes,
    fused_engine_target,
    is_expert_param,
    local_expert,
    moe_hf_names,
    router_modules,
    swiglu_names,
)
from slime.models.registry import DENSE_FIELDS, ModelFamily, register

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")


def moe_architecture(hf_config: Any, renormalise_by_default: bool = False) -> MoEArchitecture | None:
    """The MoE facts of a Qwen-MoE HF config (routed experts every decoder_sparse_step layers but mlp_only_layers,
    a gated shared expert where the config has one); None when it has no experts. `renormalise_by_default`: the
    top-k weights' renormalisation when the config has no norm_topk_prob (Qwen3.5-MoE always renormalises)."""
    num_experts = getattr(hf_config, "num_experts", None) or 0
    if num_experts <= 0:
        return None
    layers = hf_config.num_hidden_layers
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense_only = set(getattr(hf_config, "mlp_only_layers", None) or ())
    pattern = tuple(int(i not in dense_only and (i + 1) % step == 0) for i in range(layers))
    shared = getattr(hf_config, "shared_expert_intermediate_size", None) or None
    return MoEArchitecture(
        num_layers=layers,
        num_experts=num_experts,
        topk=hf_config.num_experts_per_tok,
        ffn_hidden_size=hf_config.moe_intermediate_size,
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", renormalise_by_default)),
        layer_pattern=pattern,
        shared_expert_intermediate_size=shared,
        shared_expert_gate=shared is not None,
    )


QWEN_MOE_FIELDS = table(
    ROUTER_TRAINING,
    num_experts=built("the routed experts (transformers 5 spells it num_local_experts in Qwen3-MoE)"),
    num_local_experts=built("the routed experts"),
    num_experts_per_tok=built("the router's top-k"),
    moe_intermediate_size=built("each routed expert's width"),
    norm_topk_prob=built("the top-k weights renormalised (softmax after the top-k)"),
    decoder_sparse_step=built("every decoder_sparse_step-th layer is an MoE layer"),
    mlp_only_layers=built("the layers kept dense"),
    shared_expert_intermediate_size=built("the gated shared expert's width (none when unset)"),
)
"""Qwen-MoE's expert and router fields (Qwen2-MoE, Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next)."""


def every_layer_window(hf_config: Any) -> tuple[int | None, ...] | None:
    """transformers' Qwen3-MoE class slides every layer when sliding_window is set (use_sliding_window), and has no
    layer_types."""
    window = getattr(hf_config, "sliding_window", None)
    return (window,) * hf_config.num_hidden_layers if window else None


QWEN3_MOE_FIELDS = table(DENSE_FIELDS, QWEN_MOE_FIELDS, SLIDING_WINDOW, max_window_layers=ignored(
    "transformers' Qwen3-MoE class reads none: with use_sliding_window every layer slides (built)"))
QWEN2_MOE_FIELDS = table(DENSE_FIELDS, QWEN_MOE_FIELDS, SLIDING_WINDOW,
                         qkv_bias=built("the q/k/v projections' bias (o_proj has none)"),
                         attention_bias=ignored("transformers' Qwen2-MoE class reads qkv_bias instead (built)"))


def qwen2_moe_arch_overrides(hf_config: Any) -> dict[str, Any]:
    return dict(add_qkv_bias=bool(getattr(hf_config, "qkv_bias", True)))


# Qwen3-MoE: Qwen3's attention (q/k norms); Qwen2-MoE: Qwen2's (q/k/v biases) and a gated shared expert.
QWEN3_MOE = register(ModelFamily(name="Qwen3-MoE", model_types=("qwen3_moe",), qk_layernorm=True,
                                 moe_architecture=moe_architecture, hf_fields=QWEN3_MOE_FIELDS,
                                 experts_key="num_experts", attention_windows=every_layer_window))
QWEN2_MOE = register(ModelFamily(name="Qwen2-MoE", model_types=("qwen2_moe",), qkv_bias=True,
                                 arch_overrides=qwen2_moe_arch_overrides, moe_architecture=moe_architecture,
                                 hf_fields=QWEN2_MOE_FIELDS, experts_key="num_experts",
                                 attention_windows=sliding_windows))

