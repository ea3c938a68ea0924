"""One parser for ``train.py``: upstream slime's flags, the Megatron flags users pass, SGLang passthrough and ours.

megatron-core 0.16.1 ships no ``megatron.training``, so the Megatron flags are declared here with Megatron's
names, dests and defaults (slime's overrides of them where slime has one). Flags are grouped in ``--help`` the
way upstream groups them. ``parse_args`` = parse + ``validate_args`` (derived values, cross-flag checks) +
one warning per accepted-but-unimplemented flag the user set (``NOT_IMPLEMENTED_FLAGS``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from slime.utils import sglang_passthrough
from slime.utils.misc import module_is_findable, round_up

logger = logging.getLogger(__name__)

DEFAULT_ROLLOUT_FUNCTION_PATH = "slime.rollout.sglang_rollout.generate_rollout"
ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
ATTENTION_BACKENDS = ("auto", "local", "flash", "fused", "unfused")


class ArgumentValidationError(ValueError):
    """A flag combination that cannot run; the message says which flags and what to change."""


class MissingPathError(ArgumentValidationError, FileNotFoundError):
    """A flag points at a file, directory or module that does not exist."""


class NotImplementedFlagWarning(UserWarning):
    """An accepted flag whose behaviour this project does not (yet) provide."""


# --------------------------------------------------------------------------------------------------------------
# Accepted-but-unimplemented flags: the one place to extend or shrink. A flag is reported when the user's value
# makes it active (default: differs from the parser default) and the resolved train device is in `devices`.
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class NotImplementedFlag:
    flag: str
    """The option string as users type it."""
    reason: str
    """What is missing and what happens instead."""
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    """Train devices on which the flag is unimplemented."""
    is_active: Callable[[Any], bool] | None = None
    """Predicate on the parsed value; None means 'differs from the parser default'."""


NOT_IMPLEMENTED_FLAGS: tuple[NotImplementedFlag, ...] = (
    NotImplementedFlag(flag="--optimizer-cpu-offload", reason="needs TransformerEngine's hybrid CPU optimizer"),
    NotImplementedFlag(flag="--overlap-cpu-optimizer-d2h-h2d", reason="only meaningful with --optimizer-cpu-offload"),
    NotImplementedFlag(
        flag="--use-precision-aware-optimizer", reason="needs TransformerEngine's FusedAdam; the torch Adam is used"
    ),
    NotImplementedFlag(
        flag="--attention-backend",
        reason="flash/fused/unfused need TransformerEngine; the local/plugin attention is used",
        is_active=lambda v: v not in ("auto", "local"),
    ),
    NotImplementedFlag(flag="--use-flash-attn", reason="flash-attn is not used; attention follows --attention-backend"),
    NotImplementedFlag(
        flag="--advantage-estimator", reason="ppo needs a critic model, which is not implemented", is_active=lambda v: v == "ppo"
    ),
    NotImplementedFlag(flag="--partial-rollout", reason="partial rollout is not implemented"),
    NotImplementedFlag(flag="--over-sampling-batch-size", reason="over-sampling / dynamic sampling is not implemented"),
    NotImplementedFlag(flag="--dynamic-sampling-filter-path", reason="dynamic sampling is not implemented"),
    NotImplementedFlag(flag="--check-weight-update-equal", reason="weight-update equality check is not implemented"),
    *(
        NotImplementedFlag(flag=flag, reason="this wandb option is not wired (project, group and key are)")
        for flag in ("--wandb-host", "--wandb-team", "--wandb-mode", "--wandb-dir", "--wandb-run-id",
                     "--disable-wandb-random-suffix")
    ),
    NotImplementedFlag(flag="--tb-experiment-name", reason="TensorBoard run names are not wired"),
)


def active_not_implemented_flags(args: argparse.Namespace, parser: argparse.ArgumentParser, device: str) -> list[NotImplementedFlag]:
    """The registry entries the user actually turned on, for the given train device ('cpu' or 'cuda')."""
    active = []
    for entry in NOT_IMPLEMENTED_FLAGS:
        action = parser._option_string_actions.get(entry.flag)
        if device not in entry.devices or action is None:
            continue
        value = getattr(args, action.dest)
        is_on = entry.is_active(value) if entry.is_active else value != action.default
        if is_on:
            active.append(entry)
    return active


def warn_not_implemented(args: argparse.Namespace, parser: argparse.ArgumentParser, device: str) -> list[str]:
    """One warning per active unimplemented flag; returns the flags (also stored as args.not_implemented_flags)."""
    flags = []
    for entry in active_not_implemented_flags(args, parser, device):
        warnings.warn(
            f"{entry.flag} is accepted but not implemented here ({entry.reason}); it has no effect",
            NotImplementedFlagWarning,
            stacklevel=3,
        )
        flags.append(entry.flag)
    return flags


def resolve_train_device(args: argparse.Namespace) -> str:
    """'cpu' or 'cuda' from --train-backend-device (auto: cuda when torch sees a GPU)."""
    if args.train_backend_device != "auto":
        return args.train_backend_device
    import torch  # deferred: --help and pure parsing should not pay for torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------------------------------------------
# Flag groups (help text is ours; names, dests and defaults follow upstream slime / Megatron-LM).
# --------------------------------------------------------------------------------------------------------------
def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster", "Ray placement of the training actors and rollout engines")
    g.add_argument("--actor-num-nodes", type=int, default=1, help="nodes for the training actors")
    g.add_argument("--actor-num-gpus-per-node", type=int, default=8, help="training ranks per node (GPUs, or CPU processes)")
    g.add_argument("--rollout-num-gpus", type=int, default=None, help="GPUs for rollout engines (colocate: the actor's)")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1, help="GPUs per engine (SGLang tp size)")
    g.add_argument("--num-gpus-per-node", type=int, default=8, help="GPUs per node available to rollout engines")
    g.add_argument("--engine-bind-host", type=str, default=None,
                   help="address engines listen on (this project; default: their node's address, as upstream; "
                        "0.0.0.0 listens on every interface, URLs keep the node's address)")
    g.add_argument("--colocate", action="store_true", default=False, help="train and generate on the same GPUs")
    g.add_argument("--offload", action="store_true", default=False, help="same as --offload-train --offload-rollout")
    g.add_argument("--offload-train", action=argparse.BooleanOptionalAction, default=None,
                   help="release training memory while generating (on by default with --colocate)")
    g.add_argument("--offload-rollout", action=argparse.BooleanOptionalAction, default=None,
                   help="release engine memory while training (on by default with --colocate)")
    g.add_argument("--distributed-backend", type=str, default="nccl", choices=["nccl", "gloo"],
                   help="torch.distributed backend (the CPU path uses gloo regardless)")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10, help="timeout of process-group collectives")


def _add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rollout", "generation of training samples")
    g.add_argument("--hf-checkpoint", type=str, default=None, help="HF model dir: engine weights, tokenizer, config")
    g.add_argument("--model-name", type=str, default=None, help="model family for weight conversion (default: from config)")
    g.add_argument("--rollout-function-path", type=str, default=DEFAULT_ROLLOUT_FUNCTION_PATH,
                   help="generate_rollout(args, rollout_id, data_source, evaluation=False)")
    g.add_argument("--custom-generate-function-path", type=str, default=None,
                   help="async generate(args, sample, sampling_params) replacing the per-sample generate")
    g.add_argument("--rollout-temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    g.add_argument("--rollout-top-p", type=float, default=1.0, help="sampling top-p")
    g.add_argument("--rollout-top-k", type=int, default=-1, help="sampling top-k (-1: off)")
    g.add_argument("--rollout-max-context-len", type=int, default=None, help="max prompt + response tokens")
    g.add_argument("--rollout-max-prompt-len", type=int, default=None, help="drop prompts longer than this")
    g.add_argument("--rollout-max-response-len", type=int, default=None, help="max new tokens per response")
    g.add_argument("--rollout-skip-special-tokens", action="store_true", default=False, help="detokenize without specials")
    g.add_argument("--rollout-stop", type=str, nargs="+", default=None, help="stop strings")
    g.add_argument("--rollout-stop-token-ids", type=int, nargs="+", default=None, help="stop token ids")
    g.add_argument("--rollout-shuffle", action="store_true", default=False, help="shuffle prompts each epoch")
    g.add_argument("--rollout-seed", type=int, default=42, help="seed for prompt shuffling and sampling")
    g.add_argument("--over-sampling-batch-size", type=int, default=None, help="prompts drawn per sampling round")
    g.add_argument("--dynamic-sampling-filter-path", type=str, default=None, help="DAPO-style group filter")
    g.add_argument("--partial-rollout", action="store_true", default=False, help="recycle unfinished samples")
    g.add_argument("--update-weight-buffer-size", type=int, default=512 * 1024**2,
                   help="bytes per weight-sync bucket")
    g.add_argument("--rollout-backend", type=str, default="auto", choices=["auto", "sglang", "embedded"],
                   help="engine kind: SGLang servers, or the embedded CPU engine (auto: SGLang when CUDA + sglang)")


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data", "prompt data and batch sizes")
    g.add_argument("--num-rollout", type=int, default=None, help="number of rollout steps")
    g.add_argument("--num-epoch", type=int, default=None, help="derive --num-rollout from the dataset size")
    g.add_argument("--prompt-data", type=str, default=None, help="JSONL (or parquet) prompt file")
    g.add_argument("--input-key", type=str, default="input", help="record key of the prompt")
    g.add_argument("--label-key", type=str, default=None, help="record key of the label")
    g.add_argument("--metadata-key", type=str, default="metadata", help="record key of per-sample metadata")
    g.add_argument("--tool-key", type=str, default="tools", help="record key of tools for the chat template")
    g.add_argument("--apply-chat-template", action="store_true", default=False, help="prompt is a message list")
    g.add_argument("--apply-chat-template-kwargs", type=json.loads, default="{}", help="JSON kwargs for the template")
    g.add_argument("--start-rollout-id", type=int, default=None, help="first rollout id (default: from --load or 0)")
    g.add_argument("--rollout-batch-size", type=int, required=True, help="prompts per rollout step")
    g.add_argument("--n-samples-per-prompt", type=int, default=1, help="responses per prompt")
    g.add_argument("--num-steps-per-rollout", type=int, default=None,
                   help="optimizer steps per rollout; sets --global-batch-size = rollout samples // this")
    g.add_argument("--balance-data", action="store_true", default=False, help="balance tokens across DP ranks")
    g.add_argument("--use-dynamic-batch-size", action="store_true", default=False,
                   help="pack micro-batches up to --max-tokens-per-gpu instead of --micro-batch-size samples")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None, help="token budget per rank per micro-batch")
    g.add_argument("--log-probs-max-tokens-per-gpu", type=int, default=None,
                   help="token budget for log-prob passes (default: --max-tokens-per-gpu)")


def _add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("eval", "periodic evaluation")
    g.add_argument("--eval-function-path", type=str, default=None, help="eval rollout fn (default: rollout fn)")
    g.add_argument("--eval-interval", type=int, default=None, help="evaluate every N rollouts")
    g.add_argument("--eval-prompt-data", type=str, nargs="+", default=None, metavar="NAME PATH",
                   help="pairs of dataset name and path, e.g. aime /data/aime.jsonl")
    g.add_argument("--skip-eval-before-train", action="store_true", default=False, help="no eval at rollout 0")
    g.add_argument("--eval-input-key", type=str, default=None, help="override --input-key for eval")
    g.add_argument("--eval-label-key", type=str, default=None, help="override --label-key for eval")
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1, help="responses per eval prompt")
    g.add_argument("--eval-temperature", type=float, default=None, help="eval sampling temperature")
    g.add_argument("--eval-top-p", type=float, default=None, help="eval sampling top-p")
    g.add_argument("--eval-top-k", type=int, default=None, help="eval sampling top-k")
    g.add_argument("--eval-max-response-len", type=int, default=None, help="eval max new tokens")


def _add_algorithm_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("algorithm", "RL objective")
    g.add_argument("--advantage-estimator", type=str, default="grpo", choices=ADVANTAGE_ESTIMATORS, help="advantages")
    g.add_argument("--eps-clip", type=float, default=0.2, help="PPO ratio clip (lower side)")
    g.add_argument("--eps-clip-high", type=float, default=None, help="PPO ratio clip upper side (default: --eps-clip)")
    g.add_argument("--eps-clip-c", type=float, default=None, help="dual-clip PPO bound")
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL penalty folded into rewards")
    g.add_argument("--use-kl-loss", action="store_true", default=False, help="add a KL-to-reference loss term")
    g.add_argument("--kl-loss-coef", type=float, default=0.0, help="weight of the KL loss")
    g.add_argument("--kl-loss-type", type=str, default="k1", choices=KL_LOSS_TYPES, help="KL estimator")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus weight")
    g.add_argument("--gamma", type=float, default=1.0, help="discount (PPO/REINFORCE++)")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda (PPO)")
    g.add_argument("--normalize-advantages", action="store_true", default=False, help="whiten advantages per batch")
    g.add_argument("--disable-grpo-std-normalization", action="store_false", dest="grpo_std_normalization",
                   help="GRPO: subtract the group mean only (Dr. GRPO)")
    g.add_argument("--disable-rewards-normalization", action="store_false", dest="rewards_normalization",
                   help="use raw rewards as GRPO scores")
    g.add_argument("--use-tis", action="store_true", default=False, help="truncated importance sampling vs rollout logprobs")
    g.add_argument("--tis-clip", type=float, default=2.0, help="TIS upper clip")
    g.add_argument("--tis-clip-low", type=float, default=0.0, help="TIS lower clip")
    g.add_argument("--calculate-per-token-loss", action="store_true", default=False,
                   help="normalise the loss by the step's loss-token total instead of per sample")


def _add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("reward model", "rewards of generated samples")
    g.add_argument("--rm-type", type=str, default=None, help="built-in reward: math, deepscaler, dapo, f1, remote_rm, ...")
    g.add_argument("--rm-url", type=str, default=None, help="endpoint for --rm-type remote_rm")
    g.add_argument("--reward-key", type=str, default=None, help="key of the reward when the rm returns a dict")
    g.add_argument("--eval-reward-key", type=str, default=None, help="--reward-key for eval (default: same)")
    g.add_argument("--group-rm", action="store_true", default=False, help="reward a whole group in one call")
    g.add_argument("--custom-rm-path", type=str, default=None, help="async rm(args, sample) -> float | dict")
    g.add_argument("--custom-reward-post-process-path", type=str, default=None, help="replaces GRPO normalisation")


def _add_megatron_model_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron model", "architecture (Megatron-LM names)")
    g.add_argument("--num-layers", type=int, default=None, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=None, help="hidden size")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP hidden size (default 4*hidden)")
    g.add_argument("--num-attention-heads", type=int, default=None, help="attention heads")
    g.add_argument("--group-query-attention", action="store_true", default=False, help="grouped-query attention")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="KV groups with --group-query-attention (default: from the HF config)")
    g.add_argument("--kv-channels", type=int, default=None, help="head dim (default hidden/heads)")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="max positions")
    g.add_argument("--position-embedding-type", type=str, default="learned_absolute",
                   choices=["learned_absolute", "rope", "mrope", "none"], help="position embedding")
    g.add_argument("--use-rotary-position-embeddings", action="store_true", default=False,
                   help="deprecated spelling of --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, default=None, help="RoPE base (default: from the HF config)")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="fraction of head dim rotated")
    g.add_argument("--normalization", type=str, default="LayerNorm", choices=["LayerNorm", "RMSNorm"], help="norm")
    g.add_argument("--norm-epsilon", type=float, default=None, help="norm epsilon (default: from the HF config)")
    g.add_argument("--apply-layernorm-1p", action="store_true", default=False, help="zero-centred norm weight")
    g.add_argument("--swiglu", action="store_true", default=False, help="SwiGLU MLP")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear", help="no linear biases")
    g.add_argument("--add-qkv-bias", action="store_true", default=False, help="bias on QKV only")
    g.add_argument("--qk-layernorm", action="store_true", default=False, help="norm on Q and K")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=False, help="separate lm head")
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary size before padding")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="pad vocab to a multiple of this * TP")
    g.add_argument("--seq-length", type=int, default=None, help="static sequence length (unused with packing)")
    g.add_argument("--init-method-std", type=float, default=0.02, help="init std")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="attention dropout")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="hidden dropout")
    g.add_argument("--attention-softmax-in-fp32", action="store_true", default=False, help="softmax in fp32")
    g.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion", help="unfused softmax")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion", help="unfused bias-dropout")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion", help="unfused RoPE")
    g.add_argument("--attention-backend", type=str, default="auto", choices=ATTENTION_BACKENDS, help="core attention")
    g.add_argument("--transformer-impl", type=str, default=None, choices=["local", "transformer_engine"],
                   help="layer spec (default: transformer_engine when TE and CUDA are present, else local)")
    g.add_argument("--use-flash-attn", action="store_true", default=False, help="deprecated Megatron flash-attn switch")
    g.add_argument("--bf16", action="store_true", default=False, help="bf16 parameters and compute")
    g.add_argument("--fp16", action="store_true", default=False, help="fp16 parameters and compute")


def _add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron moe", "mixture of experts (passed to megatron-core where it can)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="expert MLP hidden size")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None, help="shared expert size")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
    g.add_argument("--moe-router-load-balancing-type", type=str, default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"], help="balancing")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="aux loss weight")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="router z-loss weight")
    g.add_argument("--moe-router-score-function", type=str, default="softmax", choices=["softmax", "sigmoid"], help="score")
    g.add_argument("--moe-router-pre-softmax", action="store_true", default=False, help="softmax before top-k")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None, help="scale of top-k probs")
    g.add_argument("--moe-router-num-groups", type=int, default=None, help="device-limited routing groups")
    g.add_argument("--moe-router-group-topk", type=int, default=None, help="groups per token")
    g.add_argument("--moe-router-dtype", type=str, default=None, choices=["fp32", "fp64"], help="router precision")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true", default=False, help="aux-free balancing bias")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3, help="expert bias update rate")
    g.add_argument("--moe-token-dispatcher-type", type=str, default="allgather",
                   choices=["allgather", "alltoall", "flex"], help="token dispatcher")
    g.add_argument("--moe-grouped-gemm", action="store_true", default=False, help="grouped GEMM experts")
    g.add_argument("--moe-permute-fusion", action="store_true", default=False, help="fused permutation")
    g.add_argument("--moe-layer-freq", type=str, default="1", help="MoE layer pattern (int or python list)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None, help="capacity factor")
    g.add_argument("--moe-token-drop-policy", type=str, default="probs", choices=["probs", "position"], help="drops")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true", default=False, help="pad to capacity")
    g.add_argument("--moe-shared-expert-overlap", action="store_true", default=False, help="overlap shared expert")


def _add_megatron_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron parallel", "model parallelism and activation recomputation")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP")
    g.add_argument("--context-parallel-size", type=int, default=1, help="CP")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="expert TP (default: TP)")
    g.add_argument("--sequence-parallel", action="store_true", default=False, help="SP over the TP group")
    g.add_argument("--use-distributed-optimizer", action="store_true", default=False, help="shard optimizer over DP")
    g.add_argument("--overlap-grad-reduce", action="store_true", default=False, help="overlap DP grad reduce")
    g.add_argument("--overlap-param-gather", action="store_true", default=False, help="overlap DP param gather")
    g.add_argument("--recompute-granularity", type=str, default=None, choices=["full", "selective"], help="recompute")
    g.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"], help="recompute method")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="layers per recompute unit")


def _add_megatron_training_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron optimizer/training", "optimizer, schedule and batch")
    g.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-batch (static batching)")
    g.add_argument("--global-batch-size", type=int, default=None, help="samples per optimizer step")
    g.add_argument("--optimizer", type=str, default="adam", choices=["adam", "sgd"], help="optimizer")
    g.add_argument("--lr", type=float, default=1e-6, help="learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="floor of the decayed lr")
    g.add_argument("--lr-decay-style", type=str, default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"], help="lr schedule")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="decay length (default: train iters)")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="warmup steps")
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="warmup as a fraction of decay")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="lr at warmup start")
    g.add_argument("--train-iters", type=int, default=None, help="total optimizer steps for the schedule")
    g.add_argument("--weight-decay", type=float, default=0.01, help="weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum")
    g.add_argument("--clip-grad", type=float, default=1.0, help="global grad-norm clip (0: off)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true", default=False, help="fp32 main grads")
    g.add_argument("--use-precision-aware-optimizer", action="store_true", default=False, help="TE precision-aware Adam")
    g.add_argument("--optimizer-cpu-offload", action="store_true", default=False, help="optimizer state on CPU")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true", default=False, help="overlap offload copies")
    g.add_argument("--seed", type=int, default=1234, help="global seed")


def _add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoint", "Megatron and HF checkpoints")
    g.add_argument("--ref-load", type=str, default=None, help="reference-model checkpoint (and init when no --load)")
    g.add_argument("--load", type=str, default=None, help="resume from this Megatron checkpoint dir")
    g.add_argument("--save", type=str, default=None, help="save Megatron checkpoints here")
    g.add_argument("--save-interval", type=int, default=None, help="save every N rollouts (needs --save)")
    g.add_argument("--no-save-optim", action="store_true", default=False, help="do not save optimizer state")
    g.add_argument("--no-load-optim", action="store_true", default=False, help="do not load optimizer state")
    g.add_argument("--no-load-rng", action="store_true", default=False, help="do not load RNG state")
    g.add_argument("--finetune", action="store_true", default=False, help="load weights only, reset iteration")
    g.add_argument("--ckpt-format", type=str, default="torch_dist", choices=["torch", "torch_dist"], help="format")
    g.add_argument("--save-hf", "--save-hf-path", dest="save_hf", type=str, default=None,
                   help="also save HF weights to this path ('{rollout_id}' is filled in)")


def _add_sglang_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "sglang",
        "SGLang engines. Any --sglang-<server-arg> is passed to SGLang's ServerArgs (validated against it when sglang "
        "is importable) and collected in args.sglang_server_args; the common ones are listed here.",
    )
    g.add_argument("--sglang-mem-fraction-static", type=float, default=None, help="KV-cache memory fraction")
    g.add_argument("--sglang-cuda-graph-bs", type=int, nargs="+", default=None, help="CUDA-graph batch sizes")
    g.add_argument("--sglang-server-concurrency", type=int, default=512, help="max in-flight requests per engine")


def _add_router_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("router", "request routing over engines")
    g.add_argument("--use-slime-router", action="store_true", default=False,
                   help="use this project's router instead of sglang-router")
    g.add_argument("--sglang-router-ip", type=str, default=None, help="existing router address (default: start one)")
    g.add_argument("--sglang-router-port", type=int, default=None, help="router port")
    g.add_argument("--sglang-router-request-timeout-secs", type=int, default=14400, help="per-request timeout")
    g.add_argument("--sglang-router-policy", type=str, default=None,
                   help="sglang-router load-balancing policy (default: round_robin)")


def _add_tracking_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("wandb/tensorboard", "experiment tracking")
    g.add_argument("--use-wandb", action="store_true", default=False, help="log to Weights & Biases")
    g.add_argument("--wandb-project", type=str, default=None, help="project")
    g.add_argument("--wandb-group", type=str, default=None, help="group")
    g.add_argument("--wandb-key", type=str, default=None, help="API key")
    g.add_argument("--wandb-host", type=str, default=None, help="server")
    g.add_argument("--wandb-team", type=str, default=None, help="entity")
    g.add_argument("--wandb-mode", type=str, default=None, choices=["online", "offline", "disabled"], help="mode")
    g.add_argument("--wandb-dir", type=str, default=None, help="local dir")
    g.add_argument("--wandb-run-id", type=str, default=None, help="resume this run")
    g.add_argument("--disable-wandb-random-suffix", action="store_false", dest="wandb_random_suffix",
                   help="no random suffix on the run name")
    g.add_argument("--use-tensorboard", action="store_true", default=False, help="log to TensorBoard")
    g.add_argument("--tensorboard-dir", type=str, default=None, help="TensorBoard log dir (Megatron spelling)")
    g.add_argument("--tb-project-name", type=str, default=None, help="TensorBoard dir")
    g.add_argument("--tb-experiment-name", type=str, default=None, help="TensorBoard run name")


def _add_debug_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("debug", "reproduce train-phase problems without engines")
    g.add_argument("--save-debug-rollout-data", type=str, default=None, help="save rollouts ('{rollout_id}' template)")
    g.add_argument("--load-debug-rollout-data", type=str, default=None,
                   help="train on saved rollouts instead of generating (implies --debug-train-only)")
    g.add_argument("--debug-train-only", action="store_true", default=False, help="no engines; train only")
    g.add_argument("--debug-rollout-only", action="store_true", default=False, help="no training; rollout only")
    g.add_argument("--check-weight-update-equal", action="store_true", default=False, help="compare synced weights")


def _add_fencing_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fencing (this project)", "hang-proof training step")
    g.add_argument("--fence-timeout", type=float, default=600.0,
                   help="seconds any fence, collective or remote call may wait before the step fails with a report")
    g.add_argument("--recreate-process-groups-on-wake", action="store_true", default=False,
                   help="destroy and re-create communicators across colocate sleep (default: keep them alive)")
    g.add_argument("--train-backend-device", type=str, default="auto", choices=["auto", "cpu", "cuda"],
                   help="training device (auto: cuda when available)")
    g.add_argument("--metrics-jsonl", type=str, default=None, help="append one JSON line of metrics per step here")
    g.add_argument("--ledger-dir", type=str, default=None,
                   help="directory for per-rank collective ledgers and stall reports (default: a temp dir)")


ARGUMENT_GROUPS: tuple[Callable[[argparse.ArgumentParser], None], ...] = (
    _add_cluster_arguments,
    _add_rollout_arguments,
    _add_data_arguments,
    _add_eval_arguments,
    _add_algorithm_arguments,
    _add_reward_arguments,
    _add_megatron_model_arguments,
    _add_moe_arguments,
    _add_megatron_parallel_arguments,
    _add_megatron_training_arguments,
    _add_checkpoint_arguments,
    _add_sglang_arguments,
    _add_router_arguments,
    _add_tracking_arguments,
    _add_debug_arguments,
    _add_fencing_arguments,
)

# Hook-path flags checked for an importable module when the user sets them.
FUNCTION_PATH_FLAGS: tuple[str, ...] = (
    "--rollout-function-path",
    "--custom-generate-function-path",
    "--eval-function-path",
    "--dynamic-sampling-filter-path",
    "--custom-rm-path",
    "--custom-reward-post-process-path",
)


class SlimeArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line usage on errors: the message naming the bad flag stays visible."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n(run with --help for the list of flags)\n")


def build_parser(
    add_custom_arguments: Callable[[argparse.ArgumentParser], argparse.ArgumentParser | None] | None = None,
    prog: str | None = None,
) -> argparse.ArgumentParser:
    """The full parser. ``add_custom_arguments(parser)`` adds extra flags first, as upstream allows."""
    parser = SlimeArgumentParser(
        prog=prog,
        usage="%(prog)s [flags]",
        description="slime-compatible RL training (upstream slime + Megatron flags)",
        allow_abbrev=False,  # a typo must be an error, never a silent prefix match
    )
    if add_custom_arguments is not None:
        parser = add_custom_arguments(parser) or parser
    for add_group in ARGUMENT_GROUPS:
        add_group(parser)
    return parser


# --------------------------------------------------------------------------------------------------------------
# Validation: derived values first, then cross-flag checks. Each check is a short function raising with a fix.
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EvalDatasetSpec:
    name: str
    path: str


def _fail(message: str) -> None:
    raise ArgumentValidationError(message)


def _check_positive(args: argparse.Namespace) -> None:
    for dest in ("rollout_batch_size", "n_samples_per_prompt", "actor_num_nodes", "actor_num_gpus_per_node",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size", "rollout_num_gpus_per_engine", "micro_batch_size"):
        if getattr(args, dest) <= 0:
            _fail(f"--{dest.replace('_', '-')} must be positive, got {getattr(args, dest)}")
    if args.fence_timeout <= 0:
        _fail(f"--fence-timeout must be positive seconds, got {args.fence_timeout}")
    if args.rollout_temperature <= 0:
        _fail("--rollout-temperature must be > 0 (0 is greedy decoding, not a valid RL policy)")
    if args.max_tokens_per_gpu is not None and args.max_tokens_per_gpu <= 0:
        _fail(f"--max-tokens-per-gpu must be positive, got {args.max_tokens_per_gpu}")


def _resolve_model_defaults(args: argparse.Namespace) -> None:
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.bf16 and args.fp16:
        _fail("--bf16 and --fp16 are mutually exclusive; pass one")
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip


def _check_model_shape(args: argparse.Namespace) -> None:
    tp = args.tensor_model_parallel_size
    if args.num_attention_heads is not None and args.num_attention_heads % tp:
        _fail(f"--num-attention-heads {args.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    if args.group_query_attention and args.num_query_groups is not None:
        if args.num_attention_heads is not None and args.num_attention_heads % args.num_query_groups:
            _fail(f"--num-attention-heads {args.num_attention_heads} is not divisible by --num-query-groups "
                  f"{args.num_query_groups}")
        if args.num_query_groups % tp:
            _fail(f"--num-query-groups {args.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}")
    if args.num_layers is not None and args.num_layers % args.pipeline_model_parallel_size:
        _fail(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size "
              f"{args.pipeline_model_parallel_size}")


def _check_parallel_layout(args: argparse.Namespace) -> None:
    tp, cp, pp = args.tensor_model_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    model_parallel = tp * cp * pp
    if world % model_parallel:
        _fail(
            f"actor world size {world} (--actor-num-nodes {args.actor_num_nodes} x --actor-num-gpus-per-node "
            f"{args.actor_num_gpus_per_node}) is not divisible by TP*CP*PP = {tp}*{cp}*{pp} = {model_parallel}; "
            "change the parallel sizes or the actor GPU count"
        )
    expert_parallel = args.expert_model_parallel_size * args.expert_tensor_parallel_size * pp
    if world % expert_parallel:
        _fail(f"actor world size {world} is not divisible by EP*ETP*PP = {expert_parallel}")
    args.actor_world_size = world
    args.world_size = world
    args.data_parallel_size = world // model_parallel
    if args.sequence_parallel and tp == 1:
        warnings.warn("--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabling it", stacklevel=4)
        args.sequence_parallel = False


def _check_batching(args: argparse.Namespace) -> None:
    if args.use_dynamic_batch_size:
        if args.max_tokens_per_gpu is None:
            _fail("--use-dynamic-batch-size needs --max-tokens-per-gpu (the per-rank token budget of a micro-batch)")
        if args.log_probs_max_tokens_per_gpu is None:
            args.log_probs_max_tokens_per_gpu = args.max_tokens_per_gpu
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if args.num_steps_per_rollout is not None:
        steps = args.num_steps_per_rollout
        if steps <= 0 or samples % steps:
            _fail(f"--num-steps-per-rollout {steps} must be positive and divide rollout_batch_size * "
                  f"n_samples_per_prompt = {samples}")
        if args.global_batch_size is not None and args.global_batch_size != samples // steps:
            _fail(f"--global-batch-size {args.global_batch_size} contradicts --num-steps-per-rollout {steps} "
                  f"({samples} // {steps} = {samples // steps}); pass only one of them")
        args.global_batch_size = samples // steps
    elif args.global_batch_size is None:
        logger.info("--global-batch-size not set: one optimizer step per rollout (%d samples)", samples)
        args.global_batch_size = samples
    gbs = args.global_batch_size
    if gbs <= 0 or samples % gbs:
        _fail(f"rollout_batch_size * n_samples_per_prompt = {args.rollout_batch_size} * {args.n_samples_per_prompt} "
              f"= {samples} is not a multiple of --global-batch-size {gbs}")
    args.num_steps_per_rollout = samples // gbs


def _check_batch_split(args: argparse.Namespace) -> None:
    """Every DP rank must get the same number of samples (and static micro-batches) per step."""
    gbs, dp = args.global_batch_size, args.data_parallel_size
    if gbs % dp:
        _fail(f"--global-batch-size {gbs} is not divisible by the data-parallel size {dp}")
    if not args.use_dynamic_batch_size and gbs % (args.micro_batch_size * dp):
        _fail(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {args.micro_batch_size} x "
              f"data-parallel size {dp}; fix the sizes or use --use-dynamic-batch-size")


def _check_context_parallel(args: argparse.Namespace) -> None:
    """Zig-zag CP pads each sequence to a multiple of 2*CP and gives every CP rank two chunks of it."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    pad = 2 * cp
    if args.seq_length is not None and args.seq_length % pad:
        _fail(f"--seq-length {args.seq_length} is not a multiple of 2*CP = {pad}; CP slicing needs it "
              f"(use {round_up(args.seq_length, pad)})")
    if args.max_tokens_per_gpu is not None and args.max_tokens_per_gpu < 2:
        _fail(f"--max-tokens-per-gpu {args.max_tokens_per_gpu} cannot hold the two CP chunks every rank gets; use >= 2")
    longest = _longest_sample_tokens(args)
    if args.use_dynamic_batch_size and longest is not None and round_up(longest, pad) > args.max_tokens_per_gpu * cp:
        warnings.warn(
            f"a {longest}-token sample padded to a multiple of 2*CP exceeds --max-tokens-per-gpu {args.max_tokens_per_gpu}"
            f" x CP {cp}; such samples form over-budget micro-batches of their own",
            stacklevel=4,
        )


def _longest_sample_tokens(args: argparse.Namespace) -> int | None:
    if args.rollout_max_context_len is not None:
        return args.rollout_max_context_len
    if args.rollout_max_response_len is None:
        return None
    return args.rollout_max_response_len + (args.rollout_max_prompt_len or 1)


def _require_path(flag: str, path: str, kind: str = "path") -> None:
    if not os.path.exists(path):
        raise MissingPathError(f"{flag}: {kind} {path!r} does not exist")


def _resolve_eval_datasets(args: argparse.Namespace) -> None:
    values = list(args.eval_prompt_data or [])
    if len(values) == 1:
        logger.info("--eval-prompt-data given one path; naming the dataset 'aime' as upstream does")
        values = ["aime", values[0]]
    if len(values) % 2:
        _fail(f"--eval-prompt-data takes NAME PATH pairs; got {len(values)} values: {values}")
    args.eval_datasets = tuple(EvalDatasetSpec(values[i], values[i + 1]) for i in range(0, len(values), 2))
    args.eval_prompt_data = values or None
    if args.eval_interval is not None and not args.eval_datasets:
        _fail("--eval-interval needs --eval-prompt-data NAME PATH [NAME PATH ...]")


def _check_paths(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.hf_checkpoint is not None:
        _require_path("--hf-checkpoint", args.hf_checkpoint, "directory")
    if args.prompt_data is not None and not args.debug_train_only:
        _require_path("--prompt-data", args.prompt_data, "file")
    for spec in args.eval_datasets:
        _require_path(f"--eval-prompt-data {spec.name}", spec.path, "file")
    if args.load_debug_rollout_data is not None:
        path = args.load_debug_rollout_data
        if "{rollout_id}" in path:  # a per-rollout template: its directory must exist
            _require_path("--load-debug-rollout-data", os.path.dirname(path) or ".", "directory")
        else:
            _require_path("--load-debug-rollout-data", path, "file")
    if args.ref_load is not None and (args.use_kl_loss or args.kl_coef != 0):
        _require_path("--ref-load", args.ref_load, "checkpoint")
    for flag in FUNCTION_PATH_FLAGS:
        dest = flag[2:].replace("-", "_")
        value = getattr(args, dest)
        if value is not None and value != parser.get_default(dest) and not module_is_findable(value):
            raise MissingPathError(f"{flag}: cannot find the module of {value!r} (expected 'pkg.module.func' or "
                                   "'file.py:func')")


def _resolve_modes(args: argparse.Namespace) -> None:
    if args.debug_train_only and args.debug_rollout_only:
        _fail("--debug-train-only and --debug-rollout-only cannot both be set")
    if args.load_debug_rollout_data is not None:
        args.debug_train_only = True
    if args.debug_train_only and args.load_debug_rollout_data is None \
            and args.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION_PATH:
        _fail("--debug-train-only starts no engines, so rollouts must come from --load-debug-rollout-data PATH "
              "(or a custom --rollout-function-path that needs no engines)")
    if args.offload:
        args.offload_train = args.offload_rollout = True
    if args.colocate:
        if args.rollout_num_gpus is None:
            args.rollout_num_gpus = args.actor_num_gpus_per_node * args.actor_num_nodes
        args.offload_train = True if args.offload_train is None else args.offload_train
        args.offload_rollout = True if args.offload_rollout is None else args.offload_rollout
    if args.debug_rollout_only:  # no trainer to hand memory to (upstream turns colocation off)
        args.offload_train = args.offload_rollout = False
    args.offload_train = bool(args.offload_train)
    args.offload_rollout = bool(args.offload_rollout)
    if args.rollout_num_gpus is not None and args.rollout_num_gpus % args.rollout_num_gpus_per_engine:
        _fail(f"--rollout-num-gpus {args.rollout_num_gpus} is not divisible by --rollout-num-gpus-per-engine "
              f"{args.rollout_num_gpus_per_engine}")
    args.skip_engines = args.debug_train_only
    args.use_critic = args.advantage_estimator == "ppo"


def _resolve_rollout_defaults(args: argparse.Namespace) -> None:
    if args.num_rollout is None and args.num_epoch is None:
        _fail("set --num-rollout N (rollout steps) or --num-epoch N")
    if args.over_sampling_batch_size is not None and args.over_sampling_batch_size < args.rollout_batch_size:
        _fail(f"--over-sampling-batch-size {args.over_sampling_batch_size} must be >= --rollout-batch-size "
              f"{args.rollout_batch_size}")
    if args.eval_function_path is None:
        args.eval_function_path = args.rollout_function_path
    if args.eval_reward_key is None:
        args.eval_reward_key = args.reward_key
    if args.n_samples_per_prompt == 1:
        args.grpo_std_normalization = False  # a group of one has no spread to divide by
    if args.rollout_max_context_len is not None:
        if args.rollout_max_prompt_len is None:
            args.rollout_max_prompt_len = args.rollout_max_context_len - 1
        if args.rollout_max_prompt_len > args.rollout_max_context_len - 1:
            _fail(f"--rollout-max-prompt-len {args.rollout_max_prompt_len} leaves no room to generate within "
                  f"--rollout-max-context-len {args.rollout_max_context_len}")


def _resolve_tracking(args: argparse.Namespace) -> None:
    if args.tensorboard_dir is None and args.tb_project_name is not None:
        args.tensorboard_dir = args.tb_project_name  # upstream slime's name for the TensorBoard dir


def _check_algorithm(args: argparse.Namespace) -> None:
    if args.kl_coef != 0 and args.kl_loss_coef != 0:
        _fail("--kl-coef (reward shaping) and --kl-loss-coef (loss term) cannot both be non-zero; pick one")
    if args.advantage_estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline") \
            and not args.normalize_advantages:
        _fail(f"--advantage-estimator {args.advantage_estimator} requires --normalize-advantages")
    if args.save_interval is not None and args.save is None:
        _fail("--save-interval needs --save DIR")


def _check_rollout_backend(args: argparse.Namespace) -> None:
    """Resolve --rollout-backend once at parse time, so a choice that cannot work fails before start-up."""
    if args.debug_train_only:  # no engines
        return
    from slime.backends.sglang_utils.launcher import pick_rollout_backend

    try:
        pick_rollout_backend(args)
    except ValueError as exc:
        raise ArgumentValidationError(str(exc)) from None


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Fill derived values and check flag combinations in place; raises ArgumentValidationError with the fix."""
    parser = parser or build_parser()
    _check_positive(args)
    _resolve_model_defaults(args)
    _resolve_modes(args)
    _resolve_rollout_defaults(args)
    if not args.debug_rollout_only:
        _check_model_shape(args)
        _check_parallel_layout(args)
        _check_batching(args)
        _check_batch_split(args)
        _check_context_parallel(args)
    _check_algorithm(args)
    _resolve_tracking(args)
    _resolve_eval_datasets(args)
    _check_paths(args, parser)
    return args


def parse_args(
    argv: Sequence[str] | None = None,
    add_custom_arguments: Callable[[argparse.ArgumentParser], argparse.ArgumentParser | None] | None = None,
) -> argparse.Namespace:
    """Parse ``argv`` (default: sys.argv[1:]), validate, and warn about accepted-but-unimplemented flags.

    Unknown flags and invalid combinations exit with status 2 and a message naming the flag.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(add_custom_arguments)
    known_sglang = sglang_passthrough.registered_sglang_flags(parser)
    remaining, passthrough = sglang_passthrough.split_passthrough(argv, known_sglang)
    # Unknown flags first: argparse would otherwise report a missing required flag instead.
    unknown = [a.split("=", 1)[0] for a in remaining
               if a.startswith("--") and a.split("=", 1)[0] not in parser._option_string_actions]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args = parser.parse_args(remaining)
    try:
        args.sglang_server_args = sglang_passthrough.resolve_server_args(args, passthrough)
        validate_args(args, parser)
        _check_rollout_backend(args)
    except (ArgumentValidationError, sglang_passthrough.SGLangArgumentError) as exc:
        parser.error(str(exc))
    args.not_implemented_flags = tuple(warn_not_implemented(args, parser, resolve_train_device(args)))
    return args


if __name__ == "__main__":  # `python -m slime.utils.arguments --help` shows the flags without train.py
    print(parse_args())
