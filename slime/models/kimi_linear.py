"""Kimi-Linear (transformers' KimiLinearForCausalLM, `kimi_linear`): a hybrid stack of Kimi delta attention (KDA,
kimi_delta_attention.py) layers and multi-latent attention layers without position encoding, dense or MoE MLPs.

- `layer_types` says each layer's token mixer: "linear_attention" (KDA) or "full_attention" (MLA); the released
  config.json spells it `linear_attn_config` (1-indexed `kda_layers` / `full_attn_layers`, with the KDA's `head_dim`,
  `num_heads` and `short_conv_kernel_size`), which transformers turns into layer_types and linear_*; both are read.
- The MLA is DeepSeek-V3's (no query compression in the released model) with NoPE: transformers' class applies no
  RoPE; megatron-core's MLA rotates the shared key part by angle 0 here (`NoPositionLatentSelfAttention`), and the
  softmax scale is 1 / sqrt(qk_head_dim).
- MoE: DeepSeek-V3's sigmoid router with the routing bias, expert groups (`num_expert_group`), routed_scaling_factor
  and shared experts (sigmoid_router.py), where `mlp_layer_types` says "sparse".

Checkpoint names (as transformers saves and the released checkpoint holds them): the MLP of every layer, dense or MoE,
under `block_sparse_moe.` (`experts.E.w1/w3/w2`, `gate.weight`, `gate.e_score_correction_bias`, `shared_experts.*`,
and the dense `gate/up/down_proj`); KDA's `self_attn.{q,k,v,b}_proj`, `{q,k,v}_conv1d`, `f_a_proj`, `f_b_proj`,
`g_a_proj`, `g_b_proj`, `dt_bias`, `A_log` [1, 1, H, 1], `o_norm`, `o_proj` (layer_layouts: the megatron tensors
group them per head). transformers keeps the forget gate's under `self_attn.forget_gate.` and the three convolutions
as one `conv1d` in memory (`in_memory_target`, for the embedded engine); the push speaks the checkpoint's names,
as SGLang's loader reads them.
"""

from __future__ import annotations

import functools
from typing import Any

from slime.models.deepseek_v3 import MLA_FIELDS, attention_names, mla_arch_overrides, mla_config_fields
from slime.models.hf_fields import ROUTER_TRAINING, built, checked, ignored, must_be, table
from slime.models.registry import ModelFamily, register
from slime.models.sigmoid_router import SigmoidRouterMoE, sigmoid_router_architecture

LAYER_KINDS = ("linear_attention", "full_attention")


def _released(hf_config: Any) -> dict:
    return dict(getattr(hf_config, "linear_attn_config", None) or {})


def layer_kinds(hf_config: Any) -> tuple[str, ...]:
    """Each layer's token mixer: layer_types, or the released linear_attn_config's 1-indexed layer lists."""
    layers = hf_config.num_hidden_layers
    kinds = list(getattr(hf_config, "layer_types", None) or ())
    released = _released(hf_config)
    if not kinds and "kda_layers" in released:
        kinds = [None] * layers
        for kind, key in (("full_attention", "full_attn_layers"), ("linear_attention", "kda_layers")):
            for layer in released.get(key) or ():
                if 1 <= layer <= layers:
                    kinds[layer - 1] = kind
    if not kinds:  # transformers' default: full attention on every 4th layer but the first
        kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    if len(kinds) != layers or set(kinds) - set(LAYER_KINDS):
        raise ValueError(f"Kimi-Linear: the layer kinds {kinds} (layer_types / linear_attn_config) must give one of "
                         f"{LAYER_KINDS} for each of the {layers} layers; fix config.json")
    return tuple(kinds)


def _linear_sizes(hf_config: Any) -> tuple[int, int, int]:
    """(KDA heads, head dim, conv width), from linear_* or the released linear_attn_config."""
    released = _released(hf_config)
    return (int(released.get("num_heads", getattr(hf_config, "linear_num_heads", 32))),
            int(released.get("head_dim", getattr(hf_config, "linear_head_dim", 128))),
            int(released.get("short_conv_kernel_size", getattr(hf_config, "linear_conv_kernel_dim", 4))))


def config_fields(hf_config: Any) -> dict[str, Any]:
    """MLA's fields (no RoPE is applied: kind_layer_spec) and the KDA's sizes in megatron's linear_* fields."""
    heads, dim, kernel = _linear_sizes(hf_config)
    return dict(mla_config_fields(hf_config), linear_conv_kernel_dim=kernel, linear_key_head_dim=dim,
                linear_value_head_dim=dim, linear_num_key_heads=heads, linear_num_value_heads=heads,
                linear_attention_freq=[int(kind == "linear_attention") for kind in layer_kinds(hf_config)])


def _nope_attention_class():
    from slime.models.deepseek_v3 import _LATENT_ATTENTION

    class NoPositionLatentSelfAttention(_LATENT_ATTENTION()):
        """megatron's MLA (the project's LatentSelfAttention) with the shared key part rotated by angle 0 at every
        position: Kimi-Linear's MLA has no position encoding (the rope dimensions stay, unrotated)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.rotary_pos_emb.inv_freq.zero_()

    return NoPositionLatentSelfAttention


_NOPE_ATTENTION = functools.cache(_nope_attention_class)


def kind_layer_spec(config: Any, kind: str):
    """The local spec of a dense layer of this kind: KDA, or the MLA without position encoding."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    from slime.models.deepseek_v3 import mla_layer_spec
    from slime.models.kimi_delta_attention import KimiDeltaAttention
    from slime.models.local_spec import dense_layer_spec

    if kind == "linear_attention":
        spec = dense_layer_spec(config)
        return dataclasses.replace(spec, submodules=dataclasses.replace(
            spec.submodules, self_attention=ModuleSpec(module=KimiDeltaAttention)))
    spec = mla_layer_spec(config)
    attention = dataclasses.replace(spec.submodules.self_attention, module=_NOPE_ATTENTION())
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


def layer_spec(config: Any):
    return kind_layer_spec(config, "full_attention")


def moe_architecture(hf_config: Any):
    """The MoE layers: those `mlp_layer_types` calls sparse, behind DeepSeek-V3's sigmoid router."""
    kinds = list(getattr(hf_config, "mlp_layer_types", None) or ())
    if len(kinds) != hf_config.num_hidden_layers or set(kinds) - {"dense", "sparse"}:
        raise ValueError(f"Kimi-Linear: mlp_layer_types {kinds} must give 'dense' or 'sparse' for each of the "
                         f"{hf_config.num_hidden_layers} layers; fix config.json")
    pattern = tuple(int(kind == "sparse") for kind in kinds)
    experts = int(getattr(hf_config, "num_experts", 0) or 0)
    if not experts or 1 not in pattern:
        return None
    width = hf_config.moe_intermediate_size
    moe = SigmoidRouterMoE(
        family="Kimi-Linear MoE", experts_key="num_experts", layer_pattern=pattern, num_experts=experts,
        topk=hf_config.num_experts_per_tok, ffn_hidden_size=width, norm_topk_prob=bool(hf_config.norm_topk_prob),
        shared_expert_intermediate_size=int(getattr(hf_config, "n_shared_experts", 0) or 0) * width,
        topk_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", None) or 1.0),
        num_groups=int(getattr(hf_config, "n_group", None) or 1), group_topk=int(getattr(hf_config, "topk_group", None)
                                                                               or 1))
    return sigmoid_router_architecture(moe, hf_block="block_sparse_moe", hf_expert_projs=("w1", "w3", "w2"))


# ---------------------------------------------------------------- HF <-> megatron (pure torch, TP-independent)
def _per_head(hf_config: Any, widths: tuple[int, ...]) -> tuple:
    """HF tensors whose rows are [all heads' part 0 | all heads' part 1 | ...] (part i `widths[i]` rows a head) <->
    megatron's rows grouped per head [part 0 of h | part 1 of h | ...]."""
    import torch

    heads = _linear_sizes(hf_config)[0]

    def to_megatron(ts):
        rest = ts[0].shape[1:]
        return torch.cat([t.reshape(heads, w, *rest) for t, w in zip(ts, widths)], dim=1).reshape(-1, *rest)

    def to_hf(t):
        rest = t.shape[1:]
        return [part.reshape(-1, *rest) for part in t.reshape(heads, sum(widths), *rest).split(list(widths), dim=1)]

    return to_megatron, to_hf


def layer_layouts(prefix: str, hf_config: Any) -> dict[str, tuple]:
    import torch

    attn = f"{prefix}self_attn."
    _, dim, _ = _linear_sizes(hf_config)
    names = lambda *parts: tuple(f"{attn}{p}" for p in parts)  # noqa: E731
    rows = lambda ts: torch.cat(ts)  # noqa: E731
    return {
        "self_attention.in_proj_weight": (names("q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight"),
                                          *_per_head(hf_config, (dim, dim, dim, 1))),
        "self_attention.conv1d_weight": (names("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"),
                                         *_per_head(hf_config, (dim, dim, dim))),
        "self_attention.gate_up_weight": (names("f_b_proj.weight", "g_b_proj.weight"),
                                          *_per_head(hf_config, (dim, dim))),
        "self_attention.gate_down_weight": (names("f_a_proj.weight", "g_a_proj.weight"), rows,
                                            lambda t: list(t.chunk(2))),
        "self_attention.A_log": (names("A_log"), lambda ts: ts[0].reshape(-1),
                                 lambda t: [t.reshape(1, 1, -1, 1)]),
    }


def layer_names(prefix: str) -> dict[str, str]:
    """The MLA's names and the KDA's kept as they are (o_proj: the dense table's linear_proj)."""
    attn = f"{prefix}self_attn."
    return dict(attention_names(prefix), **{"self_attention.dt_bias": f"{attn}dt_bias",
                                            "self_attention.norm_weight": f"{attn}o_norm.weight"})


_FORGET_GATE = ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")
_CONVS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")


def in_memory_target(name: str, state_names: Any, hf_config: Any) -> tuple[str, Any] | None:
    """transformers' KimiLinearDeltaAttention keeps the forget gate's tensors under `forget_gate.` and the three
    convolutions stacked as `conv1d.weight` [q; k; v]."""
    attn, _, leaf = name.rpartition("self_attn.")
    if not attn or leaf not in _FORGET_GATE + _CONVS:
        return None
    if leaf in _FORGET_GATE:
        target = f"{attn}self_attn.forget_gate.{leaf}"
        return (target, slice(None)) if target in state_names else None
    target = f"{attn}self_attn.conv1d.weight"
    heads, dim, _ = _linear_sizes(hf_config)
    part = _CONVS.index(leaf)
    return (target, slice(part * heads * dim, (part + 1) * heads * dim)) if target in state_names else None


def check_layout(hf_config: Any, args: Any) -> None:
    """The KDA heads split over TP (before Ray starts)."""
    heads = _linear_sizes(hf_config)[0]
    tp = args.tensor_model_parallel_size
    if heads % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} does not divide the {heads} Kimi delta attention heads "
                         "(linear_num_heads / linear_attn_config.num_heads); pick a TP size that divides them")


KIMI_LINEAR_FIELDS = table(
    MLA_FIELDS, ROUTER_TRAINING,
    qk_rope_head_dim=built("qk_pos_emb_head_dim: the latent key's shared part, which Kimi-Linear does not rotate "
                           "(NoPE: megatron's MLA rotates it by angle 0)"),
    rope_interleave=ignored("not read by transformers' Kimi-Linear class: its MLA applies no RoPE"),
    num_nextn_predict_layers=checked("no MTP layers", must_be(0, "transformers' Kimi-Linear class has none"), 1),
    layer_types=built("each layer's token mixer: linear_attention (KDA) or full_attention (MLA)"),
    mlp_layer_types=built("each layer's MLP: dense or sparse (the MoE layer pattern)"),
    first_k_dense_replace=built("the dense layers, through mlp_layer_types (transformers derives it)"),
    linear_attn_config=built("the released spelling of layer_types and the KDA's sizes (transformers derives them)"),
    linear_head_dim=built("the KDA's head dim (keys and values)"),
    linear_num_heads=built("the KDA's heads"),
    linear_conv_kernel_dim=built("the KDA's causal convolution width"),
    num_local_experts=built("the routed experts (config.json: num_experts)"),
    num_experts=built("the routed experts"),
    num_experts_per_tok=built("the router's top-k (config.json: num_experts_per_token)"),
    moe_intermediate_size=built("each routed expert's width"),
    n_shared_experts=built("the ungated shared experts, n_shared_experts x moe_intermediate_size wide (config.json: "
                           "num_shared_experts)"),
    routed_scaling_factor=built("moe_router_topk_scaling_factor"),
    n_group=built("moe_router_num_groups (config.json: num_expert_group)"),
    topk_group=built("moe_router_group_topk"),
    norm_topk_prob=built("the top-k weights renormalised (config.json: moe_renormalize; refused unless it is "
                         "num_experts_per_tok > 1)"),
    model_max_length=built("max_position_embeddings as config.json stores it (transformers' alias)"),
    moe_renormalize=built("norm_topk_prob as config.json stores it"),
    num_expert_group=built("n_group as config.json stores it"),
    num_experts_per_token=built("num_experts_per_tok as config.json stores it"),
    num_shared_experts=built("n_shared_experts as config.json stores it"),
    mla_use_nope=checked("no RoPE in the MLA", must_be(True, "transformers' Kimi-Linear MLA applies none"), False),
    moe_router_activation_func=checked("the sigmoid router", must_be("sigmoid", "transformers' Kimi-Linear router "
                                                                                "is the sigmoid one"), "softmax"),
    use_grouped_topk=ignored("group-limited routing follows num_expert_group / topk_group (built)"),
    moe_layer_freq=ignored("the released config's MoE spacing, which transformers' class does not read "
                           "(mlp_layer_types: built)"),
)

KIMI_LINEAR = register(ModelFamily(
    name="Kimi-Linear",
    model_types=("kimi_linear",),
    hf_fields=KIMI_LINEAR_FIELDS,
    experts_key="num_experts",
    qk_layernorm=True,  # the latent kv norm is megatron's qk_layernorm
    rope_types=None,  # no RoPE at all (kind_layer_spec)
    arch_overrides=mla_arch_overrides,
    config_fields=config_fields,
    layer_spec=layer_spec,
    layer_kinds=layer_kinds,
    kind_layer_spec=kind_layer_spec,
    moe_architecture=moe_architecture,
    layer_names=layer_names,
    layer_layouts=layer_layouts,
    dense_mlp_block="block_sparse_moe",
    in_memory_target=in_memory_target,
    check_layout=check_layout,
    transformer_engine_spec=False,  # TransformerEngine has no KDA
))
