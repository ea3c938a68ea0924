"""gpt-oss (transformers' GptOssForCausalLM, `gpt_oss`): GQA with biases on q/k/v/o and a learned sink per head
(attention_sinks.py), sliding-window and full layers alternating (`layer_types`, `sliding_window`), YaRN RoPE on
two halves, and an MoE layer in every layer: a router with a bias (top-k of the logits, then a softmax over the k)
and experts with biases whose gate is clamped:

    gate, up = clamp(gate, max=limit), clamp(up, -limit, limit)      out = (up + 1) * gate * sigmoid(alpha * gate)

megatron-core builds that expert as its gated MLP with `glu_linear_offset` 1, `activation_func_clamp_value` limit
and x * sigmoid(alpha x) as the activation, `add_bias_linear` on every linear layer (the attention's, the router's,
the experts'). The layers are the local spec's with the sink attention in place of the core attention.

The checkpoint stacks each layer's experts into one tensor per parameter, as transformers keeps them:
`mlp.experts.gate_up_proj` [E, H, 2I] (in x out, gate and up columns interleaved), `gate_up_proj_bias` [E, 2I],
`down_proj` [E, I, H], `down_proj_bias` [E, H]; megatron's expert e holds its row (`stacked_experts`). The router
is `mlp.router.{weight, bias}`, the sinks `self_attn.sinks`. The released checkpoints hold the experts in MXFP4
(`gate_up_proj_blocks` / `_scales`, quantization_config quant_method mxfp4): dequantised to bf16 on load
(mxfp4.py); save-hf writes the bf16 checkpoint, the push the bf16 tensors. The embedded engine loads transformers'
class dequantised too. SGLang builds MXFP4 experts from an MXFP4 checkpoint, which its loader fills from
`_blocks` / `_scales` only: a push of trained bf16 experts cannot reach them, so SGLang engines are refused
before Ray starts for an MXFP4 checkpoint, naming `python -m slime.tools.dequantize_mxfp4`, which writes the bf16
checkpoint SGLang then loads (and whose bf16 `mlp.experts.*` names its loader takes in every push).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from slime.models import mxfp4
from slime.models.hf_arch import sliding_windows
from slime.models.hf_fields import CONFIG_OBJECT, DECODER, ROUTER_TRAINING, built, checked, ignored, must_be, table
from slime.models.moe_arch import MoEArchitecture
from slime.models.moe_hf import local_expert
from slime.models.registry import ModelFamily, register


# the experts' gate as released (the gain and the clamp): transformers releases before these config fields fixed
# them in the experts, and a config without them means these values
RELEASED_GATE = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


@dataclasses.dataclass(frozen=True)
class SigmoidGate:
    """x * sigmoid(alpha * x): the experts' gate activation (megatron's quick_gelu at alpha 1.702); a value, so the
    record built before Ray equals the ranks'."""

    alpha: float

    def __call__(self, x):
        import torch

        return x * torch.sigmoid(self.alpha * x)


def gpt_oss_config_fields(hf_config: Any) -> dict[str, Any]:
    """The layer fields that differ from the generic bias-free SwiGLU layer."""
    return dict(add_bias_linear=True, activation_func=SigmoidGate(_gate_field(hf_config, "swiglu_alpha")),
                glu_linear_offset=1.0, activation_func_clamp_value=_gate_field(hf_config, "swiglu_limit"),
                bias_activation_fusion=False)  # megatron fuses SwiGLU and quick-GeLU without the clamp only


def _gate_field(hf_config: Any, name: str) -> float:
    value = getattr(hf_config, name, None)
    return RELEASED_GATE[name] if value is None else float(value)


def moe_architecture(hf_config: Any) -> MoEArchitecture | None:
    """Every layer an MoE layer: num_local_experts experts of intermediate_size, top-k of the router's logits
    (with its bias), softmax over the k (megatron's softmax after top-k)."""
    experts = int(getattr(hf_config, "num_local_experts", 0) or 0)
    if experts <= 0:
        return None
    layers = hf_config.num_hidden_layers
    return MoEArchitecture(num_layers=layers, num_experts=experts, topk=hf_config.num_experts_per_tok,
                           ffn_hidden_size=hf_config.intermediate_size, norm_topk_prob=True,
                           layer_pattern=(1,) * layers, score_function="softmax")


def router_names(layer_suffix: str, prefix: str, global_expert: int | None, arch: Any) -> tuple[str, ...] | None:
    """The router (`mlp.router.weight`, `.bias`); the experts are stacked (stacked_experts)."""
    if layer_suffix in ("mlp.router.weight", "mlp.router.bias"):
        return (f"{prefix}{layer_suffix}",)
    return None


def _gate_up_rows(t, etp: int):
    """HF's interleaved [g0, u0, g1, u1, ...] rows -> megatron's fc1 rows: [gate_r; up_r] per expert-TP rank r."""
    import torch

    gate, up = t[0::2], t[1::2]
    return torch.cat([torch.cat(pair) for pair in zip(gate.chunk(etp), up.chunk(etp))])


def _interleaved_rows(t, etp: int):
    """The inverse of _gate_up_rows."""
    import torch

    halves = [chunk.chunk(2) for chunk in t.chunk(etp)]
    gate, up = torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])
    return torch.stack([gate, up], dim=1).reshape(t.shape)


def stacked_experts(layer_suffix: str, prefix: str, etp: int, hf_config: Any) -> tuple | None:
    """One expert's row of the layer's stacked expert tensors: fc1's [H, 2I] (transposed, gate and up interleaved)
    and bias [2I], fc2's [I, H] (transposed) and bias [H]."""
    expert = local_expert(layer_suffix)
    if expert is None:
        return None
    bias = ".bias" in layer_suffix
    if expert[1] == "linear_fc2":
        name = f"{prefix}mlp.experts.down_proj{'_bias' if bias else ''}"
        if bias:
            return (name,), lambda ts: ts[0], lambda t: [t]
        return (name,), lambda ts: ts[0].t(), lambda t: [t.t()]
    name = f"{prefix}mlp.experts.gate_up_proj{'_bias' if bias else ''}"
    if bias:
        return (name,), lambda ts: _gate_up_rows(ts[0], etp), lambda t: [_interleaved_rows(t, etp)]
    return (name,), lambda ts: _gate_up_rows(ts[0].t(), etp), lambda t: [_interleaved_rows(t, etp).t()]


def attention_names(prefix: str) -> dict[str, str]:
    """o_proj's bias and the sinks (q/k/v weights and biases, o_proj's weight: the dense table)."""
    return {"self_attention.linear_proj.bias": f"{prefix}self_attn.o_proj.bias",
            "self_attention.core_attention.softmax_offset": f"{prefix}self_attn.sinks"}


def layer_spec(config: Any):
    """The local dense layer spec with the sink attention (the MoE layer replaces its MLP; sliding layers get
    their window from the builder)."""
    from slime.models.attention_sinks import SinkAttention
    from slime.models.local_spec import dense_layer_spec

    spec = dense_layer_spec(config)
    attention = spec.submodules.self_attention
    attn_sub = dataclasses.replace(attention.submodules, core_attention=SinkAttention)
    sub = dataclasses.replace(spec.submodules, self_attention=dataclasses.replace(attention, submodules=attn_sub))
    return dataclasses.replace(spec, submodules=sub)


def check_flags(hf_config: Any, args: Any) -> None:
    """What gpt-oss cannot run under, before Ray starts: layers without biases, experts split over TP, SGLang
    engines for MXFP4 experts."""
    if not args.add_bias_linear:
        raise ValueError("--disable-bias-linear: gpt-oss's attention, router and experts have biases, which the "
                         "model is built with (the checkpoint holds them); drop the flag")
    if args.moe_grouped_gemm is False:
        raise ValueError("--no-moe-grouped-gemm asks for megatron-core's SequentialMLP, which cannot train experts "
                         "with biases (it scales a reduced output in place at EP 1, which autograd refuses); gpt-oss's "
                         "experts run on the project's grouped experts (the same numbers; the per-expert loop off "
                         "Hopper): drop the flag")
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    if etp > 1:
        raise ValueError(f"--expert-tensor-parallel-size {etp} (it defaults to --tensor-model-parallel-size): "
                         "megatron-core builds experts with biases (gpt-oss's) unsplit only; pass "
                         "--expert-tensor-parallel-size 1 (the experts then split over --expert-model-parallel-size)")
    if not mxfp4.is_mxfp4(getattr(hf_config, "quantization_config", None)) or args.debug_train_only:
        return
    from slime.config.engine import pick_rollout_backend

    if pick_rollout_backend(args) == "sglang":
        raise ValueError("the checkpoint's experts are MXFP4 (quantization_config quant_method mxfp4): SGLang builds "
                         "MXFP4 experts from it, which the weight push of the trained (bf16) experts cannot update; "
                         "write the bf16 checkpoint once (python -m slime.tools.dequantize_mxfp4 SRC DST) and pass "
                         "--hf-checkpoint DST (the trainer dequantises either way; the embedded engine takes both)")


def _quantization(value: Any, hf_config: Any) -> str | None:
    if not value or mxfp4.is_mxfp4(value):
        return None
    method = value.get("quant_method", "?") if isinstance(value, dict) else type(value).__name__
    return f"quantized weights ({method}) are not dequantised on load here; MXFP4 experts and bf16 / fp32 ones are"


def _experts_per_token(value: Any, hf_config: Any) -> str | None:
    if value is None or value == hf_config.num_experts_per_tok:
        return None
    return f"the original code's name of num_experts_per_tok ({hf_config.num_experts_per_tok}), which transformers reads"


GPT_OSS_FIELDS = table(
    CONFIG_OBJECT, DECODER, ROUTER_TRAINING,
    quantization_config=checked("unquantized weights, or MXFP4 experts dequantised to bf16 on load", _quantization,
                                {"quant_method": "fp8"}),
    intermediate_size=built("each expert's width (every layer is an MoE layer)"),
    hidden_act=ignored("transformers' gpt-oss experts do not read it: their gate is x * sigmoid(swiglu_alpha x), "
                       "clamped (built)"),
    attention_bias=checked("biases on q/k/v/o (the router and experts have theirs whatever it says)",
                           must_be(True, "transformers' experts and router always have biases; the attention's are "
                                         "built with them"), False),
    sliding_window=built("the key window of the sliding_attention layers"),
    layer_types=built("each layer's attention: sliding_attention or full_attention"),
    num_local_experts=built("the routed experts"),
    num_experts_per_tok=built("the router's top-k (a softmax over the k logits)"),
    swiglu_alpha=built("the experts' gate x * sigmoid(alpha x) (absent: RELEASED_GATE's)"),
    swiglu_limit=built("the experts' clamp (gate from above, up on both sides): activation_func_clamp_value "
                       "(absent: RELEASED_GATE's)"),
    experts_per_token=checked("num_experts_per_tok's value", _experts_per_token, 99),
    initial_context_length=ignored("the released config's pre-YaRN context; rope_parameters' "
                                   "original_max_position_embeddings is what RoPE reads"),
)

GPT_OSS = register(ModelFamily(
    name="gpt-oss",
    model_types=("gpt_oss",),
    hf_fields=GPT_OSS_FIELDS,
    experts_key="num_local_experts",
    attention_windows=sliding_windows,
    sglang_serves_windows=True,
    qkv_bias=True,  # with o_proj's, from add_bias_linear (config_fields)
    rope_types=("default", "yarn"),
    config_fields=gpt_oss_config_fields,
    layer_spec=layer_spec,
    moe_architecture=moe_architecture,
    moe_names=router_names,
    stacked_experts=stacked_experts,
    layer_names=attention_names,
    check_layout=check_flags,
))
