"""megatron's local (no TransformerEngine) dense layer spec with this project's SP-capable norms and
CP/THD-capable core attention: the base every local layer spec here starts from."""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from slime.models.cp_attention import ContextParallelAttention
from slime.models.sp_norm import SequenceParallelNorm


def dense_layer_spec(config: TransformerConfig) -> ModuleSpec:
    """megatron's local GPT layer spec with SP-capable norms and CP/THD-capable core attention."""
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    sub = spec.submodules
    attention = sub.self_attention
    attn_sub = dataclasses.replace(
        attention.submodules,
        core_attention=ContextParallelAttention,
        q_layernorm=SequenceParallelNorm if config.qk_layernorm else attention.submodules.q_layernorm,
        k_layernorm=SequenceParallelNorm if config.qk_layernorm else attention.submodules.k_layernorm,
    )
    sub = dataclasses.replace(
        sub,
        input_layernorm=SequenceParallelNorm,
        pre_mlp_layernorm=SequenceParallelNorm,
        self_attention=dataclasses.replace(attention, submodules=attn_sub),
    )
    return dataclasses.replace(spec, submodules=sub)


def with_attention_window(spec: ModuleSpec, window: int | None) -> ModuleSpec:
    """`spec` (a local layer spec with the project's core attention) whose queries see only the last `window` keys
    (themselves included); `spec` itself for None (full causal attention)."""
    if window is None:
        return spec
    attention = spec.submodules.self_attention
    core = attention.submodules.core_attention
    if not (isinstance(core, type) and issubclass(core, ContextParallelAttention)):
        raise TypeError(f"a sliding window is built by ContextParallelAttention; this layer's core attention is {core}")
    windowed = ModuleSpec(module=core, params={"window": window})
    attn_sub = dataclasses.replace(attention.submodules, core_attention=windowed)
    sub = dataclasses.replace(spec.submodules, self_attention=dataclasses.replace(attention, submodules=attn_sub))
    return dataclasses.replace(spec, submodules=sub)


def with_moe_mlp(spec: ModuleSpec, config: TransformerConfig, grouped: bool = False) -> ModuleSpec:
    """`spec` (a local layer spec with our norms) with its MLP replaced by megatron's MoE layer, whose experts
    are megatron's SequentialMLP or, with `grouped` or experts with biases, the project's GroupedExperts (same
    parameters): megatron-core 0.16's SequentialMLP scales a biased expert's output in place, which autograd
    refuses at EP 1."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from slime.models.grouped_experts import GroupedExperts

    moe = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if grouped or config.add_bias_linear:
        experts = dataclasses.replace(moe.submodules.experts, module=GroupedExperts)
        moe = dataclasses.replace(moe, submodules=dataclasses.replace(moe.submodules, experts=experts))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=moe))
