"""MiniMax-M2 (transformers' MiniMaxM2ForCausalLM): the family (`MINIMAX_M2`, at the end), whose layer spec is
also upstream's `--spec` plug-in: `--spec slime_plugins.models.minimax_m2 get_minimax_m2_spec`.

A MiniMax-M2 layer is GQA without biases, RoPE on the first `partial_rotary_factor` of each head's dimensions
(config `rotary_dim`; two halves, not interleaved), and an MoE layer in every layer: DeepSeek-V3's sigmoid router
with the routing bias, top-k renormalised, no scaling, no expert groups and no shared expert (sigmoid_router.py).

Its q and k norms differ from Qwen3's: one RMSNorm over the whole q projection (all heads together) and one over
the whole k projection, not one per head. Under TP each rank holds some heads, so `FullWidthRMSNorm` sums the
squares over the TP group (an all-reduce in forward and in backward) and keeps its weight split by heads like
the projection (HF q_norm / k_norm rows; the generic TP split in hf_weights.py).

The checkpoint spells the MoE block as Mixtral does: block_sparse_moe.gate.weight, block_sparse_moe.
e_score_correction_bias (on the block, not on the gate) and block_sparse_moe.experts.E.w1 / w3 / w2 (gate /
up / down); transformers renames them to mlp.* in memory (the embedded engine's checkpoint_target follows).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from slime.models.hf_fields import CONFIG_OBJECT, DECODER, ROUTER_TRAINING, built, ignored, table
from slime.models.registry import ModelFamily, register
from slime.models.sigmoid_router import SigmoidRouterMoE, sigmoid_router_architecture

MINIMAX_M2_MODEL_TYPES = ("minimax_m2",)


def moe_architecture(hf_config: Any):
    """Every layer an MoE layer of num_local_experts experts of intermediate_size."""
    experts = int(getattr(hf_config, "num_local_experts", None) or 0)
    if experts <= 0:
        return None
    moe = SigmoidRouterMoE(
        family="MiniMax-M2 MoE",
        experts_key="num_local_experts",
        layer_pattern=(1,) * hf_config.num_hidden_layers,
        num_experts=experts,
        topk=hf_config.num_experts_per_tok,
        ffn_hidden_size=hf_config.intermediate_size,
        norm_topk_prob=True,  # MiniMaxM2TopKRouter always renormalises the top-k weights
    )
    return sigmoid_router_architecture(moe, hf_block="block_sparse_moe", hf_expert_projs=("w1", "w3", "w2"),
                                       hf_expert_bias="e_score_correction_bias")


def _tp_sum_class():
    import torch

    class _TPSum(torch.autograd.Function):
        """Sum over the TP group; each rank's output feeds only its own heads, so the gradient is summed too."""

        @staticmethod
        def forward(ctx, tensor):
            from megatron.core import parallel_state

            total = tensor.clone()
            torch.distributed.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
            return total

        @staticmethod
        def backward(ctx, grad):
            from megatron.core import parallel_state

            grad = grad.contiguous().clone()
            torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
            return grad

    return _TPSum


_TP_SUM = functools.cache(_tp_sum_class)


def _full_width_norm_class():
    import torch
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    class FullWidthRMSNorm(torch.nn.Module):
        """RMSNorm over all heads of q (heads="query") or k (heads="key") of a token, as MiniMax-M2's q_norm /
        k_norm; megatron builds it as q_layernorm / k_layernorm and calls it on [s, b, local heads, head dim]."""

        def __init__(self, config, hidden_size: int, eps: float = 1e-6, heads: str = "query"):
            super().__init__()
            total = config.num_attention_heads if heads == "query" else config.num_query_groups
            tp = config.tensor_model_parallel_size
            if total % tp:
                raise ValueError(f"MiniMax-M2: --tensor-model-parallel-size {tp} does not divide the {total} {heads} "
                                 "heads its q/k norm spans; pick a TP size that divides it")
            self.tp, self.eps, self.width = tp, eps, total * hidden_size
            self.weight = torch.nn.Parameter(torch.ones(total // tp * hidden_size, dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

        def forward(self, heads: torch.Tensor) -> torch.Tensor:
            flat = heads.reshape(*heads.shape[:-2], -1).float()
            squares = flat.pow(2).sum(-1, keepdim=True)
            if self.tp > 1:
                squares = _TP_SUM().apply(squares)
            normed = flat * torch.rsqrt(squares / self.width + self.eps)
            return (self.weight * normed.to(heads.dtype)).reshape(heads.shape)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            # split over TP like the projection rows (megatron's default would take it as replicated)
            return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                       {"weight": 0}, sharded_offsets)

    FullWidthRMSNorm.__qualname__ = FullWidthRMSNorm.__name__  # found by name through __getattr__ (pickle, repr)
    return FullWidthRMSNorm


_FULL_WIDTH_NORM = functools.cache(_full_width_norm_class)


def __getattr__(name: str) -> type:
    if name == "FullWidthRMSNorm":
        return _FULL_WIDTH_NORM()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def layer_spec(config: Any):
    """The local dense layer spec with MiniMax-M2's whole-projection q/k norms (MoE layers replace its MLP)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from slime.models.local_spec import dense_layer_spec

    spec = dense_layer_spec(config)
    sub = spec.submodules
    norm = _FULL_WIDTH_NORM()
    attention = sub.self_attention
    attn_sub = dataclasses.replace(attention.submodules, q_layernorm=ModuleSpec(module=norm, params={"heads": "query"}),
                                   k_layernorm=ModuleSpec(module=norm, params={"heads": "key"}))
    sub = dataclasses.replace(sub, self_attention=dataclasses.replace(attention, submodules=attn_sub))
    return dataclasses.replace(spec, submodules=sub)


def get_minimax_m2_spec(args: Any, config: Any, vp_stage: int | None = None):
    """The MiniMax-M2 layer spec (upstream's --spec signature): every layer with megatron's MoE layer, its
    experts grouped as --moe-grouped-gemm says."""
    from slime.models.grouped_experts import grouped_experts_chosen
    from slime.models.local_spec import with_moe_mlp

    if not config.num_moe_experts:
        raise ValueError("--spec slime_plugins.models.minimax_m2 get_minimax_m2_spec builds MoE layers; the HF "
                         "config has no experts (num_local_experts): drop --spec for a dense checkpoint")
    return with_moe_mlp(layer_spec(config), config, grouped_experts_chosen(args.moe_grouped_gemm))


MINIMAX_M2_FIELDS = table(
    CONFIG_OBJECT, DECODER, ROUTER_TRAINING,
    intermediate_size=built("each routed expert's width (every layer is an MoE layer)"),
    num_local_experts=built("the routed experts"),
    num_experts_per_tok=built("the router's top-k (renormalised, as MiniMaxM2TopKRouter always does)"),
    rotary_dim=built("partial_rotary_factor = rotary_dim / head_dim (transformers converts the released spelling)"),
    router_jitter_noise=ignored("multiplicative noise on the router input in HF's training mode only: the engines "
                                "route without it, and the trainer's log-probs and gradient are those of the same "
                                "noiseless router (megatron's --moe-input-jitter-eps adds jitter only if asked)"),
)

MINIMAX_M2 = register(ModelFamily(
    name="MiniMax-M2",
    model_types=MINIMAX_M2_MODEL_TYPES,
    hf_fields=MINIMAX_M2_FIELDS,
    experts_key="num_local_experts",
    spec_plugins=("slime_plugins.models.minimax_m2 get_minimax_m2_spec",),
    qk_layernorm=True,  # over whole projections (FullWidthRMSNorm); HF q_norm / k_norm
    layer_spec=layer_spec,
    moe_architecture=moe_architecture,
))
