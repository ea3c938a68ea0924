"""Mixture-of-experts for the megatron builder: the MoE fields of TransformerConfig, the MoE layer spec,
the checks of --num-experts / EP / top-k against the HF config, and the aux-loss scale of a step.

The HF side (what an MoE checkpoint holds and how its names map) lives with the model families in
slime/models (each MoE family's ModelFamily.moe gives one MoEArchitecture); this module speaks megatron. The router (score function,
expert bias, top-k scaling, group-limited routing) and the shared expert come from the HF config: a flag
that says otherwise is refused, since the engines run the HF model. Training-only router knobs (aux-loss
types and weights, the expert-bias update rate, router dtype) go to megatron unchanged.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import warnings
from argparse import Namespace
from typing import Any, Iterator

import torch

from slime.models.moe_arch import MoEArchitecture
from slime.models.registry import family_of


class MoEConfigError(ValueError):
    """The MoE flags contradict the HF config or the parallel layout."""


# HF architecture field -> (megatron flag dest, TransformerConfig field)
_ARCH_TO_FLAG = {
    "num_experts": "num_experts",
    "topk": "moe_router_topk",
    "ffn_hidden_size": "moe_ffn_hidden_size",
    "shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "score_function": "moe_router_score_function",
    "topk_scaling_factor": "moe_router_topk_scaling_factor",
    "num_groups": "moe_router_num_groups",
    "group_topk": "moe_router_group_topk",
}


def _eval_layer_freq(node: ast.AST) -> Any:
    """A python literal, or upstream's list arithmetic ([0]*3+[1]*58): ints, lists, list * int and list + list."""
    if isinstance(node, ast.Expression):
        return _eval_layer_freq(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval_layer_freq(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
        left, right = _eval_layer_freq(node.left), _eval_layer_freq(node.right)
        return left * right if isinstance(node.op, ast.Mult) else left + right
    raise MoEConfigError(f"--moe-layer-freq: cannot read {ast.unparse(node)!r}; pass an int or a list such as "
                         "[0]*3+[1]*58")


def _parse_layer_freq(value: Any, num_layers: int) -> list[int]:
    """--moe-layer-freq: an int k (every k-th layer is MoE) or a python list of 0/1 per layer."""
    if isinstance(value, (list, tuple)):
        pattern = [int(v) for v in value]
    else:
        parsed = _eval_layer_freq(ast.parse(value, mode="eval")) if isinstance(value, str) else value
        if isinstance(parsed, int):
            pattern = [1 if i % parsed == 0 else 0 for i in range(num_layers)]
        else:
            pattern = [int(v) for v in parsed]
    if len(pattern) != num_layers:
        raise MoEConfigError(f"--moe-layer-freq {value} gives {len(pattern)} layers, the model has {num_layers}")
    return pattern


def check_moe_args(arch: MoEArchitecture, args: Namespace) -> None:
    """Flags the user passed must agree with the checkpoint; EP must divide the experts."""
    for field, dest in _ARCH_TO_FLAG.items():
        given = getattr(args, dest)
        value = getattr(arch, field)
        if given is not None and not _same(given, value):
            raise MoEConfigError(
                f"--{dest.replace('_', '-')} {given} does not match the HF checkpoint's config ({field}={value}); "
                f"pass --{dest.replace('_', '-')} {value} or point --hf-checkpoint at a model with {given}")
    freq = args.moe_layer_freq
    if freq is not None:
        if _parse_layer_freq(freq, arch.num_layers) != list(arch.layer_pattern):
            raise MoEConfigError(f"--moe-layer-freq {freq} does not match the HF config's MoE layers "
                                 f"{list(arch.layer_pattern)}; drop the flag or pass that list")
    if args.moe_router_enable_expert_bias and not arch.expert_bias:
        raise MoEConfigError("--moe-router-enable-expert-bias adds a routing bias the HF model has no tensor for "
                             "(the engines would route without it); drop the flag")
    if args.moe_shared_expert_gate and not arch.shared_expert_gate:
        raise MoEConfigError("--moe-shared-expert-gate asks for a gated shared expert, the HF checkpoint has none; "
                             "drop the flag")
    if args.moe_router_pre_softmax and arch.score_function == "sigmoid":
        warnings.warn("--moe-router-pre-softmax has no effect with the sigmoid router (megatron-core reads it for "
                      "softmax scores only); the HF config's routing is used", stacklevel=2)
    if args.moe_router_pre_softmax and arch.score_function == "softmax" and arch.norm_topk_prob:
        raise MoEConfigError("--moe-router-pre-softmax keeps the top-k weights unnormalised, the HF config "
                             "renormalises them (norm_topk_prob=true); drop the flag")
    ep = args.expert_model_parallel_size
    if arch.num_experts % ep:
        raise MoEConfigError(f"--expert-model-parallel-size {ep} does not divide the checkpoint's "
                             f"{arch.num_experts} experts; use a divisor of {arch.num_experts}")
    if arch.topk > arch.num_experts:
        raise MoEConfigError(f"top-k {arch.topk} is above the expert count {arch.num_experts}")


def _same(given: Any, value: Any) -> bool:
    if isinstance(value, float) and isinstance(given, (int, float)):
        return abs(given - value) <= 1e-9 * max(1.0, abs(value))
    return given == value


def _router_fields(arch: MoEArchitecture) -> dict[str, Any]:
    """megatron's router fields of the HF router. Softmax (Qwen): softmax over all experts, top-k, then
    (norm_topk_prob) renormalised over the k; megatron's softmax-after-top-k is exactly the renormalised form.
    Sigmoid (DeepSeek-V3): megatron renormalises the top-k whenever k > 1, as deepseek_v3.py checks."""
    return dict(
        # a score function megatron-core has no name for (DeepSeek-V4's sqrt(softplus)) is computed by the family's
        # own router (its layer spec replaces megatron's); megatron's config checks the expert bias against sigmoid
        moe_router_score_function=arch.score_function if arch.score_function in ("softmax", "sigmoid") else "sigmoid",
        moe_router_pre_softmax=arch.score_function == "softmax" and not arch.norm_topk_prob,
        moe_router_enable_expert_bias=arch.expert_bias,
        moe_router_topk_scaling_factor=arch.topk_scaling_factor if arch.topk_scaling_factor != 1.0 else None,
        moe_router_num_groups=arch.num_groups if arch.grouped else None,
        moe_router_group_topk=arch.group_topk if arch.grouped else None,
    )


def moe_config_fields(hf_config: Any, args: Namespace) -> dict[str, Any]:
    """TransformerConfig fields of an MoE HF config (empty for a dense one)."""
    arch = family_of(hf_config).moe(hf_config)
    if arch is None:
        if routing_replay_enabled(args):
            raise MoEConfigError("--use-routing-replay / --use-rollout-routing-replay replay MoE routes, and the "
                                 "HF checkpoint is dense; drop the flag or point --hf-checkpoint at an MoE model")
        if args.num_experts:
            raise MoEConfigError(f"--num-experts {args.num_experts} is set but the HF checkpoint is dense "
                                 f"(model_type {getattr(hf_config, 'model_type', '?')}); drop --num-experts or "
                                 "point --hf-checkpoint at an MoE model")
        return {}
    check_moe_args(arch, args)
    dispatcher = token_dispatcher(args)
    ep, pp = args.expert_model_parallel_size, args.pipeline_model_parallel_size
    if dispatcher == "allgather" and (ep > 1 or pp > 1):
        raise MoEConfigError("--moe-token-dispatcher-type allgather needs equal token counts on the ranks it "
                             "gathers over, which dynamic batches do not give under EP > 1 or PP > 1; use "
                             "--moe-token-dispatcher-type alltoall")
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.topk,
        moe_ffn_hidden_size=arch.ffn_hidden_size,
        moe_layer_freq=list(arch.layer_pattern),
        **_router_fields(arch),
        moe_router_bias_update_rate=_bias_update_rate(args),
        moe_router_dtype=args.moe_router_dtype,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=float(args.moe_aux_loss_coeff),
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_token_dispatcher_type=dispatcher,
        moe_flex_dispatcher_backend="deepep",  # read by megatron only with the flex dispatcher
        moe_grouped_gemm=grouped_gemm_available() and bool(args.moe_grouped_gemm),
        moe_permute_fusion=False,  # the fused kernels are TransformerEngine's; see warn_unavailable_kernels
        moe_shared_expert_intermediate_size=arch.shared_expert_intermediate_size,
        moe_shared_expert_gate=arch.shared_expert_gate,
        moe_shared_expert_overlap=bool(args.moe_shared_expert_overlap),
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_token_drop_policy=args.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=bool(args.moe_pad_expert_input_to_capacity),
        moe_enable_routing_replay=routing_replay_enabled(args),
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )


def _cuda_with(package: str) -> bool:
    """CUDA and an importable `package`."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def deep_ep_available() -> bool:
    """DeepEP's kernels: CUDA and the deep_ep package."""
    return _cuda_with("deep_ep")


_warned_no_deepep = False


def _first_rank() -> bool:
    """One warning per run, not per rank: the ranks decide alike."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def token_dispatcher(args: Namespace) -> str:
    """--moe-token-dispatcher-type, with upstream's DeepEP request (flex / --moe-enable-deepep) served by megatron's
    flex dispatcher where DeepEP is installed, else by alltoall: the routing is the same whichever transport
    moves the tokens, so the run goes on (one warning, from the first rank)."""
    global _warned_no_deepep
    dispatcher = args.moe_token_dispatcher_type
    if dispatcher != "flex" and not args.moe_enable_deepep:
        return dispatcher
    if deep_ep_available():
        warnings.warn("DeepEP dispatcher (flex): its exchanges run in DeepEP's own buffers, which the fence's "
                      "ledger does not record", stacklevel=2)
        return "flex"
    if not _warned_no_deepep and _first_rank():
        _warned_no_deepep = True
        warnings.warn("=" * 20 + " --moe-token-dispatcher-type flex / --moe-enable-deepep asked for DeepEP, and "
                      f"{'deep_ep is not installed' if torch.cuda.is_available() else 'DeepEP needs CUDA'}: the "
                      "tokens move with the alltoall dispatcher instead (the same routing and results; all-to-all "
                      "exchanges over the EP group) " + "=" * 20, stacklevel=2)
    return "alltoall"


def _bias_update_rate(args: Namespace) -> float:
    """--moe-router-bias-update-rate (megatron's default 1e-3 when not given; 0 keeps the HF bias fixed)."""
    rate = args.moe_router_bias_update_rate
    return 1e-3 if rate is None else float(rate)


def routing_replay_enabled(args: Namespace) -> bool:
    return bool(args.use_routing_replay or args.use_rollout_routing_replay)


def grouped_gemm_available() -> bool:
    """megatron's own grouped expert GEMM (TE spec) needs TransformerEngine on CUDA."""
    return _cuda_with("transformer_engine")


def grouped_experts_enabled(args: Namespace) -> bool:
    """--moe-grouped-gemm: the project's grouped experts (slime/models/grouped_experts.py) in the local spec."""
    from slime.models.grouped_experts import grouped_experts_chosen

    return grouped_experts_chosen(args.moe_grouped_gemm)


def warn_unavailable_kernels(args: Namespace) -> None:
    """--moe-permute-fusion asks for TransformerEngine's fused permutation; the maths is the same without it."""
    if args.moe_permute_fusion:
        warnings.warn("--moe-permute-fusion: TransformerEngine's fused permutation kernels are not used; the "
                      "dispatcher permutes the tokens by expert once per layer with torch ops, and the grouped "
                      "experts apply the routing weights inside their activation; same results", stacklevel=2)


def moe_layer_specs(dense_spec, moe_spec, config, vp_stage: int | None) -> list:
    """One layer spec per local layer: the MoE spec where --moe-layer-freq says so, the dense one elsewhere."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pattern = config.moe_layer_freq
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return [moe_spec if pattern[offset + i] else dense_spec for i in range(count)]


@contextlib.contextmanager
def aux_loss_scale(config: Any, num_micro_batches: int, dp_size: int) -> Iterator[None]:
    """Weight the router's aux loss the same way in both loss normalisations: as megatron does without
    per-token loss, its mean over the step's micro-batches and DP ranks. (Per-token mode leaves megatron
    summing it, which would make the aux gradient grow with the micro-batch count of dynamic batching.)"""
    if getattr(config, "num_moe_experts", None) is None or not config.calculate_per_token_loss:
        yield
        return
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    original = MoEAuxLossAutoScaler.set_loss_scale
    factor = 1.0 / (num_micro_batches * dp_size)
    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(lambda scale: original(scale * factor))
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = staticmethod(original)


def moe_plan_collectives(config: Any) -> tuple[tuple[str, bool], ...]:
    """The MoE collectives a step runs, for the plan fingerprint: every rank must agree on them."""
    moe_on = bool(getattr(config, "num_moe_experts", None))
    return (
        ("moe_alltoall", moe_on and config.moe_token_dispatcher_type == "alltoall"),
        ("moe_allgather", moe_on and config.moe_token_dispatcher_type == "allgather"),
        ("moe_flex", moe_on and config.moe_token_dispatcher_type == "flex"),
        ("moe_aux_loss", moe_on and bool(config.moe_aux_loss_coeff)),
        ("moe_expert_bias", moe_on and bool(config.moe_router_enable_expert_bias)),
        ("routing_replay", moe_on and bool(config.moe_enable_routing_replay)),
    )
