"""Checks of the LoRA flags against the HF config, before Ray starts: every target names a linear layer the model
builder builds, the rank fits each target layer's width (a routed expert's too), and the expert layout is one LoRA
serves. Under --advantage-estimator ppo the critic gets the same adapters (critic_role.critic_args)."""

from __future__ import annotations

import argparse
import warnings

from slime.config.errors import derive, fail
from slime.config.flags.training import LORA_TARGET_MODULES
from slime.models.registry import routed_experts


ALL_LINEAR = "all-linear"
"""PEFT's and Megatron-Bridge's name for every linear layer of the transformer blocks (the output layer excluded)."""


def check_lora_flags(args: argparse.Namespace) -> None:
    if ALL_LINEAR in args.lora_target_modules:
        if len(args.lora_target_modules) > 1:
            fail(f"--lora-target-modules {ALL_LINEAR} names every linear layer already; pass it alone")
        derive(args, "lora_target_modules", list(LORA_TARGET_MODULES),
               f"--lora-target-modules {ALL_LINEAR}: every linear layer of the transformer blocks")
    if not args.enable_lora:
        return
    if args.lora_rank <= 0:
        fail(f"--lora-rank {args.lora_rank}: the adapter rank must be positive")
    if not 0.0 <= args.lora_dropout < 1.0:
        fail(f"--lora-dropout {args.lora_dropout}: a dropout probability in [0, 1)")
    if args.freeze_params_name_list:
        warnings.warn("--freeze-params-name-list has no effect with --enable-lora: LoRA freezes every base parameter "
                      "(--only-train-params-name-list names those to train in full beside the adapters)", stacklevel=2)
    unknown = [t for t in args.lora_target_modules if t not in LORA_TARGET_MODULES]
    if unknown:
        fail(f"--lora-target-modules {' '.join(unknown)} names no module LoRA adapts; pick from "
             f"{' '.join(LORA_TARGET_MODULES)} (megatron-core's names: linear_qkv holds q/k/v_proj, linear_fc1 "
             "gate/up_proj, linear_proj o_proj, linear_fc2 down_proj)")


EXPERT_TARGETS = ("linear_fc1", "linear_fc2")
"""The targets that also adapt each routed expert's MLP."""


def lora_layer_widths(config: dict) -> dict[str, int]:
    """min(in, out) of each target layer of an HF config (the widest rank an adapter can use); a routed expert's
    MLP (moe_intermediate_size) bounds fc1/fc2 too."""
    hidden = config.get("hidden_size")
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    kv = config.get("num_key_value_heads") or heads
    ffn = config.get("intermediate_size")
    if not all(isinstance(v, int) for v in (hidden, heads, head_dim, kv, ffn)):
        return {}
    moe_ffn = config.get("moe_intermediate_size") if routed_experts(config) else None
    ffn = min(ffn, moe_ffn) if isinstance(moe_ffn, int) else ffn
    return {"linear_qkv": min(hidden, (heads + 2 * kv) * head_dim), "linear_proj": min(heads * head_dim, hidden),
            "linear_fc1": min(hidden, 2 * ffn), "linear_fc2": min(ffn, hidden)}


def check_lora_against_config(args: argparse.Namespace, config: dict, config_path: str) -> None:
    if not args.enable_lora:
        return
    if config.get("kv_lora_rank") is not None and "linear_qkv" in args.lora_target_modules:
        fail(f"--lora-target-modules linear_qkv names no module of {config_path}: its multi-latent attention has "
             "no fused qkv layer; adapt linear_proj linear_fc1 linear_fc2")
    _check_expert_layout(args, config, config_path)
    widths = lora_layer_widths(config)
    for target in args.lora_target_modules:
        width = widths.get(target)
        if width is not None and args.lora_rank > width:
            fail(f"--lora-rank {args.lora_rank} is above the width of {target} ({width}, the smaller of its input "
                 f"and output sizes in {config_path}); pick --lora-rank <= {width}")


def _check_expert_layout(args: argparse.Namespace, config: dict, config_path: str) -> None:
    """A routed expert's adapter is local to its rank: the experts must not be split over tensor-parallel ranks."""
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    targets = [t for t in args.lora_target_modules if t in EXPERT_TARGETS]
    if routed_experts(config) and targets and etp > 1:
        fail(f"--lora-target-modules {' '.join(targets)} adapts the routed experts of {config_path}, whose adapters "
             f"are local to their rank: pass --expert-tensor-parallel-size 1 (it is {etp}; experts then split over "
             "--expert-model-parallel-size, which must be above 1 at TP > 1), or adapt linear_qkv linear_proj only")
