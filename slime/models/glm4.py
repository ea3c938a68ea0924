"""GLM-4 dense (transformers' Glm4ForCausalLM): the family (`GLM4`, at the end), whose layer spec is also
upstream's `--spec` plug-in: `--spec slime_plugins.models.glm4 get_glm_spec`.

A GLM-4 layer is a Llama layer (GQA with q/k/v biases, SwiGLU, RMSNorm) with two more norms, each on a
branch's output before its residual add (HF post_self_attn_layernorm, post_mlp_layernorm), and RoPE on the
first half of each head's dimensions in interleaved pairs (config.rotary_interleaved, rotary_percent 0.5).
The norms live inside the attention and MLP modules here, so megatron's TransformerLayer runs unchanged;
their megatron names are self_attention.post_self_attn_layernorm and mlp.post_mlp_layernorm.
HF stores the MLP's gate and up rows fused (gate_up_proj = [gate; up]).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from slime.models.hf_fields import CONFIG_OBJECT, DECODER, built, table
from slime.models.registry import ModelFamily, register

GLM4_MODEL_TYPES = ("glm4",)


def is_glm4(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", "") in GLM4_MODEL_TYPES


def _post_norm(config: Any):
    from slime.models.sp_norm import SequenceParallelNorm

    return SequenceParallelNorm(config, config.hidden_size, eps=config.layernorm_epsilon)


def _normed(norm: Any, output_and_bias: tuple, what: str) -> tuple:
    output, bias = output_and_bias
    if bias is not None:
        raise ValueError(f"GLM-4's {what} has no bias; the post norm would come before it")
    return norm(output), None


@functools.cache
def _post_norm_modules() -> tuple[type, type]:
    """(PostNormSelfAttention, PostNormMLP), made on first use (megatron is imported only once a model is built)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP

    class PostNormSelfAttention(SelfAttention):
        """megatron's SelfAttention whose output is normalised (GLM-4's post_self_attn_layernorm)."""

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.post_self_attn_layernorm = _post_norm(config)

        def forward(self, *args, **kwargs):
            return _normed(self.post_self_attn_layernorm, super().forward(*args, **kwargs), "o_proj")

    class PostNormMLP(MLP):
        """megatron's MLP whose output is normalised (GLM-4's post_mlp_layernorm)."""

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.post_mlp_layernorm = _post_norm(config)

        def forward(self, *args, **kwargs):
            return _normed(self.post_mlp_layernorm, super().forward(*args, **kwargs), "down_proj")

    for module in (PostNormSelfAttention, PostNormMLP):
        module.__qualname__ = module.__name__  # found by name through the module's __getattr__ (pickle, repr)
    return PostNormSelfAttention, PostNormMLP


def __getattr__(name: str) -> type:
    if name in ("PostNormSelfAttention", "PostNormMLP"):
        return _post_norm_modules()[name == "PostNormMLP"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_glm_spec(args: Any, config: Any, vp_stage: int | None = None):
    """The GLM-4 layer spec (upstream's --spec signature): the local dense spec with post norms."""
    from slime.models.local_spec import dense_layer_spec

    attention, mlp = _post_norm_modules()
    spec = dense_layer_spec(config)
    sub = spec.submodules
    sub = dataclasses.replace(sub, self_attention=dataclasses.replace(sub.self_attention, module=attention),
                              mlp=dataclasses.replace(sub.mlp, module=mlp))
    return dataclasses.replace(spec, submodules=sub)


def layer_names(prefix: str) -> dict[str, str]:
    """megatron suffix -> HF name of the post norms."""
    return {
        "self_attention.post_self_attn_layernorm.weight": f"{prefix}post_self_attn_layernorm.weight",
        "mlp.post_mlp_layernorm.weight": f"{prefix}post_mlp_layernorm.weight",
    }


def fused_gate_up_name(prefix: str) -> str:
    return f"{prefix}mlp.gate_up_proj.weight"


GLM4_FIELDS = table(
    CONFIG_OBJECT, DECODER,
    attention_bias=built("the q/k/v projections' bias (o_proj has none)"),
)


def glm4_arch_overrides(hf_config: Any) -> dict[str, Any]:
    """q/k/v biases as the config says (Glm4Config's attention_bias, on by default)."""
    return dict(add_qkv_bias=bool(getattr(hf_config, "attention_bias", True)))


GLM4 = register(ModelFamily(
    name="GLM-4",
    model_types=GLM4_MODEL_TYPES,
    hf_fields=GLM4_FIELDS,
    arch_overrides=glm4_arch_overrides,
    spec_plugins=("slime_plugins.models.glm4 get_glm_spec",),
    qkv_bias=True,
    rotary_interleaved=True,
    post_norms=True,
    default_spec=get_glm_spec,
    layer_names=layer_names,
    fused_gate_up=fused_gate_up_name,
))
