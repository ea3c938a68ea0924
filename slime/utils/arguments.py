"""One parser for ``train.py``: upstream slime's flags, the Megatron flags users pass, SGLang passthrough and ours.

megatron-core 0.16.1 ships no ``megatron.training``, so the Megatron flags are declared here with Megatron's
names, dests and defaults (slime's overrides of them where slime has one). Flags are grouped in ``--help`` the
way upstream groups them; every flag shows its default and a one-line meaning. ``parse_args`` = parse +
``--custom-config-path`` overrides + ``validate_args`` (derived values, cross-flag checks, flags refused because
they would change the maths without being implemented: ``REFUSED_FLAGS``) + one warning per
accepted-but-unimplemented flag the user set (``NOT_IMPLEMENTED_FLAGS``). Every flag the parser accepts is read
by the code or sits in one of the two registries (tests/test_flag_rule.py checks it).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import logging
import os
import sys
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from slime.utils import sglang_passthrough
from slime.utils.deadlines import DeadlineModel, default_group_timeout_minutes
from slime.rollout.eval_config import EvalDatasetSpec, load_eval_config
from slime.utils.misc import load_function, module_is_findable, round_up
from slime.utils.security import resolve_api_key, shown

logger = logging.getLogger(__name__)

DEFAULT_ROLLOUT_FUNCTION_PATH = "slime.rollout.sglang_rollout.generate_rollout"
DEFAULT_DATA_SOURCE_PATH = "slime.rollout.data_source.RolloutDataSourceWithBuffer"
ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
ATTENTION_BACKENDS = ("auto", "local", "flash", "fused", "unfused")
LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")


class ArgumentValidationError(ValueError):
    """A flag combination that cannot run; the message says which flags and what to change."""


class MissingPathError(ArgumentValidationError, FileNotFoundError):
    """A flag points at a file, directory or module that does not exist."""


class NotImplementedFlagWarning(UserWarning):
    """An accepted flag whose behaviour this project does not (yet) provide."""


# --------------------------------------------------------------------------------------------------------------
# The two registries: flags accepted with a loud warning (no effect on the maths), and flags refused at parse time
# (they would change the maths, or the run, and are not implemented). An entry applies when the user's value makes
# it active (default: differs from the parser default) and the resolved train device is in `devices`.
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


def _warned(reason: str, *flags: str) -> tuple[NotImplementedFlag, ...]:
    return tuple(NotImplementedFlag(flag=flag, reason=reason) for flag in flags)


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
    NotImplementedFlag(flag="--check-weight-update-equal", reason="weight-update equality check is not implemented"),
    *_warned("this wandb option is not wired (project, group and key are)", "--wandb-host", "--wandb-team",
             "--wandb-mode", "--wandb-dir", "--wandb-run-id", "--disable-wandb-random-suffix",
             "--wandb-always-use-train-step"),
    *_warned("gradients are reduced at a fixed place of the step (finalize_model_grads), never overlapped",
             "--overlap-grad-reduce", "--overlap-param-gather"),
    *_warned("a memory/speed option of upstream's loss code; log-probs are computed in one pass",
             "--log-probs-chunk-size", "--recompute-loss-function"),
    *_warned("FP8 rollout weights are not implemented (weights are sent in the training dtype)",
             "--force-fp8-ue8m0-scale"),
    *_warned("Qwen3-Next / Qwen3.5 gated delta-net layers are not implemented (their --spec is refused), so no GDN "
             "kernel is chosen", "--qwen-gdn-backend"),
    *_warned("the straw rollout transport is not available (rollouts travel through the Ray object store)",
             "--rollout-data-dir", "--rollout-storage-profile", "--rollout-storage-declaration",
             "--rollout-queue-run-id", "--rollout-queue-online-gc", "--rollout-queue-lease-seconds",
             "--rollout-queue-segment-mib", "--rollout-io-concurrency"),
    *_warned("retained internal serving / training recovery is not implemented", "--rollout-session-id",
             "--rollout-cleanup-timeout"),
    *_warned("FLOPs-balanced micro-batches are not implemented; --balance-data balances tokens",
             "--balance-by-flops"),
    *_warned("eval requests are bounded by --eval-max-response-len and --rollout-max-context-len",
             "--eval-max-context-len"),
    *_warned("checkpoints are saved synchronously", "--async-save"),
    *_warned("replayed routes of a step are held in memory whole; nothing is prefetched",
             "--routing-replay-prefetch-microbatches"),
    *_warned("a PPO critic option; --advantage-estimator ppo (a critic) is not implemented", "--value-clip",
             "--lambd"),
    *_warned("pass@k is always logged here (rollout/pass@k)", "--log-passrate"),
    *_warned("this rollout logging option is not implemented", "--log-multi-turn", "--log-reward-category",
             "--log-correct-samples"),
    *_warned("the trainer logs the entropy of the training pass only", "--use-rollout-entropy"),
    *_warned("the saved rollout is replayed whole", "--load-debug-rollout-data-subsample"),
    *_warned("memory snapshots are not implemented", "--memory-snapshot-dir", "--memory-snapshot-num-steps",
             "--memory-recorder", "--record-memory-history"),
    *_warned("HTTP requests go directly to the router/engines", "--http-proxy", "--use-distributed-post"),
    *_warned("read only by upstream's rollout-buffer example plug-ins; nothing here uses it", "--rollout-buffer-url",
             "--fetch-trajectory-retry-times", "--min-batch-collection-ratio", "--rollout-task-type",
             "--loss-mask-type", "--data-pad-size-multiplier"),
    *_warned("TransformerEngine DeepGEMM forwards are not used", "--megatron-deepgemm-forward-layers",
             "--megatron-deepgemm-forward-modules", "--megatron-deepgemm-moe-forward-layers",
             "--megatron-deepgemm-moe-forward-modules"),
    *_warned("multi-token prediction is not supported", "--mtp-loss-scaling-factor"),
    *_warned("megatron-core's experimental features are not used by this model builder", "--enable-experimental"),
    *_warned("not wired: GPU runs use the default (non-deterministic) kernels; CPU runs are deterministic",
             "--deterministic-mode"),
    *_warned("a non-finite loss always skips the step on every rank together (the fenced step's rule); that "
             "check cannot be turned off", "--no-check-for-nan-in-loss-and-grad"),
    *_warned("upstream's CI assertions are not implemented", "--ci-test", "--ci-disable-kl-checker",
             "--ci-train-rollout-logprob-abs-diff-threshold", "--ci-save-grad-norm", "--ci-load-grad-norm"),
    *_warned("the vocabulary is padded to --make-vocab-size-divisible-by x TP", "--padded-vocab-size"),
    *_warned("weights always come from --hf-checkpoint / --load; nothing is randomly initialised",
             "--init-method-std"),
    *_warned("--optimizer sgd is not implemented", "--sgd-momentum"),
    *_warned("every checkpoint holds each rank's RNG state (an exact resume needs it); --no-load-rng skips "
             "restoring it", "--no-save-rng"),
    # upstream slime's remaining non-model flags (the "upstream compatibility" group)
    NotImplementedFlag(flag="--keep-old-actor",
                       reason="the old-policy pass already runs on the weights that generated the rollout (train.py "
                              "pushes after every train), so no second copy is kept"),
    *_warned("torch profiler traces are not written", "--profile-target", "--use-pytorch-profiler",
             "--profile-step-start", "--profile-step-end", "--profile-ranks", "--profile"),
    *_warned("a colocated trainer releases and restores its whole memory at sleep; no margin is reserved",
             "--train-memory-margin-bytes"),
    *_warned("a sleeping trainer always keeps the host copy of its weights (the weight push reads it)",
             "--disable-weights-backuper"),
    NotImplementedFlag(flag="--megatron-to-hf-mode", is_active=lambda v: v != "raw",
                       reason="the project's own HF <-> megatron name mapping is used, not Megatron-Bridge"),
    NotImplementedFlag(flag="--qkv-format", is_active=lambda v: v != "thd",
                       reason="micro-batches are always packed THD sequences"),
    *_warned("eval runs on the rollout engines", "--eval-num-gpus"),
    *_warned("this Megatron logging option is not wired; metrics are logged every rollout",
             "--log-throughput", "--log-timers-to-tensorboard", "--tensorboard-log-interval", "--log-params-norm",
             "--timing-log-level"),
    *_warned("every checkpoint under --save is kept", "--save-retain-interval", "--keep-checkpoint-num"),
)

# Flags that ask for what this project always does: accepted, read by nobody, and that is correct.
ALWAYS_HONOURED_FLAGS: dict[str, str] = {
    "--swiglu": "the dense builder always builds the HF config's SwiGLU MLP",
    "--disable-bias-linear": "the dense builder never adds linear biases (Qwen3 / Llama configs have none)",
    "--attention-softmax-in-fp32": "megatron-core computes the attention softmax in fp32 by default",
    "--no-masked-softmax-fusion": "fused softmax kernels are always off (they are CUDA-only)",
    "--no-bias-dropout-fusion": "bias-dropout fusion is always off",
    "--no-rope-fusion": "RoPE fusion is always off",
    "--allgather-cp": "context-parallel attention always all-gathers K/V over the CP group",
    "--train-backend": "megatron-core is the only training backend",
    "--no-gradient-accumulation-fusion": "gradient-accumulation fusion (a CUDA kernel) is always off",
    "--no-position-embedding": "no learned absolute position embedding is ever added; positions are the HF "
                               "config's RoPE",
}

REFUSED_FLAGS: tuple[NotImplementedFlag, ...] = (
    NotImplementedFlag(flag="--advantage-estimator", is_active=lambda v: v in ("ppo", "cispo"),
                       reason="ppo needs a critic model and cispo its own objective, neither is implemented; use grpo, "
                              "gspo, reinforce_plus_plus or reinforce_plus_plus_baseline"),
    NotImplementedFlag(flag="--optimizer", is_active=lambda v: v != "adam", reason="only --optimizer adam is implemented"),
    NotImplementedFlag(flag="--pg-loss-type", is_active=lambda v: v == "reinforce",
                       reason="the REINFORCE objective is not implemented (the PPO-clip objective is)"),
    NotImplementedFlag(flag="--use-score-centering", reason="score centering is not implemented"),
    NotImplementedFlag(flag="--score-centering-top-k", reason="score centering is not implemented"),
    NotImplementedFlag(flag="--use-unbiased-kl", reason="the importance-weighted (unbiased) KL is not implemented"),
    NotImplementedFlag(flag="--use-opsm", reason="off-policy sequence masking is not implemented"),
    NotImplementedFlag(flag="--opsm-delta", reason="off-policy sequence masking is not implemented"),
    NotImplementedFlag(flag="--num-critic-only-steps", reason="critic training (ppo) is not implemented"),
    NotImplementedFlag(flag="--megatron-config-path", reason="per-role (critic) Megatron configs are not implemented"),
    NotImplementedFlag(flag="--reset-optimizer-states", reason="resetting optimizer state per rollout is not implemented"),
    NotImplementedFlag(flag="--use-stateless-adam", reason="stateless Adam is not implemented"),
    NotImplementedFlag(flag="--moe-token-dispatcher-type", is_active=lambda v: v == "flex",
                       reason="the flex dispatcher needs DeepEP (CUDA kernels); use alltoall"),
    NotImplementedFlag(flag="--mtp-num-layers", reason="multi-token prediction layers are not supported"),
    NotImplementedFlag(flag="--enable-mtp-training", reason="multi-token prediction layers are not supported"),
    *(NotImplementedFlag(flag=f, reason="the dense builder has no such layers (Qwen3 / Qwen2 / Llama only)")
      for f in ("--freeze-indexer",)),
    NotImplementedFlag(flag="--attention-output-gate",
                       reason="gated attention output (Qwen3-Next / Qwen3.5) is not implemented; no builder here has "
                              "such layers yet"),
    *(NotImplementedFlag(flag=f, reason="FP8 training needs TransformerEngine's FP8 layers, which this model builder "
                                        "does not use; drop it to train in bf16 (--bf16) or fp32")
      for f in ("--fp8-format", "--fp8-recipe")),
    *(NotImplementedFlag(flag=f, reason="weights reach the engines only over CUDA IPC, shared memory or the "
                                        "distributed group (--update-weight-transport), never through files on disk")
      for f in ("--update-weight-disk-dir", "--update-weight-disk-keep-files", "--update-weight-local-checkpoint-dir")),
    *(NotImplementedFlag(flag=f, reason="delta weight updates are not implemented (--update-weight-mode full: every "
                                        "push sends the full weights)")
      for f in ("--update-weight-delta-encoding", "--update-weight-delta-checksum")),
    NotImplementedFlag(flag="--moe-enable-deepep",
                       reason="DeepEP's dispatcher needs CUDA and the deep_ep package, which this project does not "
                              "use; use --moe-token-dispatcher-type alltoall (the same routing, all-to-all exchanges)"),
    NotImplementedFlag(flag="--release-train", reason="releasing the train actors needs disk weight sync, not implemented"),
    NotImplementedFlag(flag="--flush-cache-interval", is_active=lambda v: v != 1,
                       reason="the engines' cache is flushed at every weight sync; a longer interval is not implemented"),
    NotImplementedFlag(flag="--rollout-data-transport", is_active=lambda v: v != "object-store",
                       reason="only the Ray object store carries rollouts here"),
    NotImplementedFlag(flag="--rollout-external-engine-addrs",
                       reason="external engines are not supported; the rollout manager launches its own"),
    NotImplementedFlag(flag="--multimodal-keys", reason="multimodal prompts are not supported"),
    NotImplementedFlag(flag="--load-forge-rollout-data",
                       reason="replaying rollouts with live engines is not implemented; --load-debug-rollout-data "
                              "replays without engines"),
    NotImplementedFlag(flag="--ckpt-format", is_active=lambda v: v != "torch_dist",
                       reason="checkpoints are saved and loaded with dist_checkpointing (torch_dist) only"),
    NotImplementedFlag(flag="--fp16", reason="fp16 training (loss scaling) is not implemented; use --bf16 or fp32"),
    NotImplementedFlag(flag="--apply-layernorm-1p", reason="the HF Qwen3 / Qwen2 / Llama norms are plain RMSNorm"),
    # upstream slime's remaining non-model flags (the "upstream compatibility" group)
    NotImplementedFlag(flag="--sglang-config",
                       reason="engine groups (prefill / decode / placeholder, per-group overrides) are not implemented; "
                              "every engine is a regular server of --rollout-num-gpus-per-engine GPUs"),
    NotImplementedFlag(flag="--prefill-num-servers", reason="prefill/decode disaggregation is not implemented"),
    NotImplementedFlag(flag="--slime-router-middleware-paths",
                       reason="upstream's router middlewares are Starlette classes; this project's router is an aiohttp "
                              "server and cannot mount them (its radix-tree cache middleware is not implemented)"),
    NotImplementedFlag(flag="--custom-update-weight-post-write-path",
                       reason="it runs after a disk weight update, and weights never go through disk here "
                              "(--update-weight-transport disk is not implemented)"),
    NotImplementedFlag(flag="--true-on-policy-mode",
                       reason="bit-exact train/rollout numerics (matched kernels on both sides) are not implemented"),
    NotImplementedFlag(flag="--use-dynamic-global-batch-size",
                       reason="the global batch is fixed by --global-batch-size / --num-steps-per-rollout"),
    *(NotImplementedFlag(flag=f, reason="critic training (--advantage-estimator ppo) is not implemented")
      for f in ("--critic-num-nodes", "--critic-num-gpus-per-node", "--critic-load", "--critic-save", "--critic-lr",
                "--critic-lr-warmup-iters")),
    NotImplementedFlag(flag="--rollout-external",
                       reason="external engines are not supported; the rollout manager launches its own"),
    NotImplementedFlag(flag="--ckpt-step", reason="--load resumes from its latest iteration; pick one with "
                                                   "latest_checkpointed_iteration.txt"),
    NotImplementedFlag(flag="--exit-interval", reason="a run ends after --num-rollout rollouts; set that instead"),
)


def _active(entries: Sequence[NotImplementedFlag], args: argparse.Namespace, parser: argparse.ArgumentParser,
            device: str) -> list[NotImplementedFlag]:
    active = []
    for entry in entries:
        action = parser._option_string_actions.get(entry.flag)
        if device not in entry.devices or action is None:
            continue
        value = getattr(args, action.dest)
        is_on = entry.is_active(value) if entry.is_active else value != action.default
        if is_on:
            active.append(entry)
    return active


def active_not_implemented_flags(args: argparse.Namespace, parser: argparse.ArgumentParser, device: str) -> list[NotImplementedFlag]:
    """The registry entries the user actually turned on, for the given train device ('cpu' or 'cuda')."""
    return _active(NOT_IMPLEMENTED_FLAGS, args, parser, device)


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


def refusal_messages(args: argparse.Namespace, parser: argparse.ArgumentParser, device: str) -> list[str]:
    """One line per active refused flag: it would change the maths and is not implemented."""
    messages = []
    for entry in _active(REFUSED_FLAGS, args, parser, device):
        value = getattr(args, parser._option_string_actions[entry.flag].dest)
        shown = "" if isinstance(value, bool) else f" {_shown(value)}"
        messages.append(f"{entry.flag}{shown} is not supported here: {entry.reason}")
    return messages


def refuse_unsupported(args: argparse.Namespace, parser: argparse.ArgumentParser, device: str) -> None:
    """Raise naming every active refused flag at once."""
    messages = refusal_messages(args, parser, device)
    if messages:
        _fail("; ".join(messages))


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def resolve_train_device(args: argparse.Namespace) -> str:
    """'cpu' or 'cuda' from --train-backend-device (auto: cuda when torch sees a GPU)."""
    if args.train_backend_device != "auto":
        return args.train_backend_device
    import torch  # deferred: --help and pure parsing should not pay for torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1, with an error that says so."""
    return _bounded_int(text, 1, "a positive integer")


def _non_negative_int(text: str) -> int:
    return _bounded_int(text, 0, "a non-negative integer")


def _bounded_int(text: str, lowest: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"{value} is not {what}")
    return value


# --------------------------------------------------------------------------------------------------------------
# Flag groups (help text is ours; names, dests and defaults follow upstream slime / Megatron-LM).
# --------------------------------------------------------------------------------------------------------------
def _add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster", "Ray placement of the training actors and rollout engines")
    g.add_argument("--actor-num-nodes", type=int, default=1, help="nodes that run training ranks")
    g.add_argument("--actor-num-gpus-per-node", type=int, default=8,
                   help="training ranks per node (one GPU each; CPU processes on the embedded default)")
    g.add_argument("--rollout-num-gpus", type=int, default=None,
                   help="GPUs for the rollout engines (with --colocate: the training ranks' GPUs)")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1,
                   help="GPUs per rollout engine (the engine's SGLang tensor-parallel size)")
    g.add_argument("--num-gpus-per-node", type=int, default=8, help="GPUs per node that rollout engines may use")
    g.add_argument("--engine-bind-host", type=str, default=None,
                   help="address engines listen on (this project; default: their node's address, as upstream; "
                        "0.0.0.0 listens on every interface, URLs keep the node's address)")
    g.add_argument("--colocate", action="store_true", default=False,
                   help="train and generate on the same GPUs, handing memory over between the two")
    g.add_argument("--offload", action="store_true", default=False, help="shorthand for --offload-train --offload-rollout")
    g.add_argument("--offload-train", action=argparse.BooleanOptionalAction, default=None,
                   help="release training memory while generating (on by default with --colocate)")
    g.add_argument("--offload-rollout", action=argparse.BooleanOptionalAction, default=None,
                   help="release engine memory while training (on by default with --colocate)")
    g.add_argument("--distributed-backend", type=str, default="nccl", choices=["nccl", "gloo"],
                   help="torch.distributed backend of the trainer on GPUs (CPU ranks always use gloo)")
    g.add_argument("--distributed-timeout-minutes", type=int, default=None,
                   help="timeout of process-group collectives (default: just above the watchdog's longest window, "
                        "derived from --fence-timeout; a smaller value is refused)")
    g.add_argument("--train-env-vars", type=json.loads, default="{}",
                   help='JSON object of environment variables set in every training rank, e.g. \'{"NCCL_DEBUG": "WARN"}\'')


def _add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rollout", "generation of training samples")
    g.add_argument("--hf-checkpoint", type=str, default=None,
                   help="HF model directory: the engines' first weights, the tokenizer and the model config")
    g.add_argument("--model-name", type=str, default=None,
                   help="model family of the HF checkpoint (qwen3, qwen2, llama, deepseek_v3, glm4); must match its config.json")
    g.add_argument("--rollout-function-path", type=str, default=DEFAULT_ROLLOUT_FUNCTION_PATH,
                   help="rollout function fn(args, rollout_id, data_source, evaluation=False)")
    g.add_argument("--custom-generate-function-path", type=str, default=None,
                   help="async fn(args, sample, sampling_params[, evaluation]) -> Sample | list[Sample] replacing "
                        "the per-sample generate (multi-turn, tools)")
    g.add_argument("--rollout-sample-hook-path", action="append", default=[],
                   help="fn(args, sample, *, rollout_id, evaluation) -> Sample | None applied to each finished "
                        "sample before its reward (repeatable)")
    g.add_argument("--rollout-temperature", type=float, default=1.0, help="sampling temperature of rollouts (> 0)")
    g.add_argument("--rollout-top-p", type=float, default=1.0, help="nucleus-sampling probability mass of rollouts")
    g.add_argument("--rollout-top-k", type=int, default=-1, help="sample among the k likeliest tokens (-1: all)")
    g.add_argument("--rollout-max-context-len", type=int, default=None,
                   help="most prompt + response tokens of a rollout sample (default: the model's context)")
    g.add_argument("--rollout-max-prompt-len", type=int, default=None,
                   help="prompts with more tokens are skipped when the data is read")
    g.add_argument("--rollout-max-response-len", type=int, default=None,
                   help="most new tokens per rollout response (SGLang max_new_tokens)")
    g.add_argument("--rollout-skip-special-tokens", action="store_true", default=False,
                   help="detokenize responses without special tokens")
    g.add_argument("--rollout-stop", type=str, nargs="+", default=None, help="strings that end a rollout response")
    g.add_argument("--rollout-stop-token-ids", type=int, nargs="+", default=None,
                   help="token ids that end a rollout response")
    g.add_argument("--rollout-shuffle", action="store_true", default=False, help="shuffle the prompts every epoch")
    g.add_argument("--rollout-seed", type=int, default=42, help="seed of the prompt shuffling")
    g.add_argument("--over-sampling-batch-size", type=int, default=None,
                   help="prompts drawn per sampling round when more groups are needed (default: --rollout-batch-size)")
    g.add_argument("--dynamic-sampling-filter-path", type=str, default=None,
                   help="fn(args, group) -> DynamicFilterOutput deciding whether a finished group is kept (DAPO: "
                        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std)")
    g.add_argument("--partial-rollout", action="store_true", default=False,
                   help="keep groups aborted at the end of a rollout in a buffer and resume them in a later one")
    g.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true", default=False,
                   help="with --partial-rollout: exclude tokens generated by an earlier policy from the loss")
    g.add_argument("--buffer-filter-path", type=str, default=None,
                   help="fn(args, rollout_id, buffer, num_samples) -> groups taken from the partial-rollout buffer "
                        "(default: the oldest first)")
    g.add_argument("--buffer-sort-by-staleness", action="store_true", default=False,
                   help="resume buffered groups with the oldest weight version first")
    g.add_argument("--rollout-sample-filter-path", type=str, default=None,
                   help="fn(args, groups) run on the kept groups; may set sample.remove_sample to drop its loss")
    g.add_argument("--rollout-all-samples-process-path", type=str, default=None,
                   help="fn(args, all_groups, data_source) run on every finished group, dropped ones included")
    g.add_argument("--custom-rollout-log-function-path", type=str, default=None,
                   help="fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool; True skips "
                        "the default rollout logging")
    g.add_argument("--custom-eval-rollout-log-function-path", type=str, default=None,
                   help="fn(rollout_id, args, data, extra_metrics) -> bool; True skips the default eval logging")
    g.add_argument("--rollout-data-postprocess-path", type=str, default=None,
                   help="fn(args, rollout_id, rollout_data) on every training rank after log-probs and advantages, "
                        "before training (e.g. to edit loss masks)")
    g.add_argument("--release-train", action="store_true", default=False,
                   help="release the train actors during rollout and recreate them before training")
    g.add_argument("--update-weight-buffer-size", type=int, default=512 * 1024**2,
                   help="bytes per weight-sync bucket")
    # Weight-sync transport (upstream's names): colocated engines get tensors, others the broadcast group.
    g.add_argument("--update-weight-mode", type=str, default="full", choices=["full", "delta", "sparse"],
                   help="what a sync sends: full weights (delta and sparse are not implemented: refused)")
    g.add_argument("--update-weight-transport", type=str, default="nccl", choices=["nccl", "disk"],
                   help="nccl: CUDA-IPC tensors to colocated engines, a broadcast group (NCCL; gloo on CPU) to "
                        "others; disk is not implemented (refused)")
    # train_async.py (slime/ray/async_schedule.py): how often the engines get new weights, how stale a
    # fully-async sample may be.
    g.add_argument("--update-weights-interval", type=_positive_int, default=1,
                   help="train_async.py: push the trained weights to the engines every N rollouts")
    g.add_argument("--max-weight-staleness", type=_non_negative_int, default=None,
                   help="fully-async rollout: drop groups generated more than N weight versions before the engines' "
                        "current one (counted in rollout/staleness/dropped_groups; default: keep every group)")
    g.add_argument("--flush-cache-interval", type=int, default=1,
                   help="flush the engines' KV cache every N weight syncs (only 1 is implemented)")
    g.add_argument("--rollout-data-transport", type=str, default="object-store",
                   choices=["straw", "object-store", "nixl"], help="how rollouts reach the trainer (Ray object store)")
    g.add_argument("--rollout-data-dir", type=str, default=None, help="shared directory of straw rollout payloads")
    g.add_argument("--rollout-storage-profile", type=str, default="local", choices=["local", "juicefs"],
                   help="storage profile of the straw transport")
    g.add_argument("--rollout-storage-declaration", type=str, default=None,
                   help="JSON file declaring the straw transport's storage")
    g.add_argument("--rollout-queue-run-id", type=str, default="rollout", help="straw queue run identity")
    g.add_argument("--rollout-queue-online-gc", action="store_true", default=False,
                   help="reclaim used straw packs during training")
    g.add_argument("--rollout-queue-lease-seconds", type=float, default=300, help="lease of a straw queue entry")
    g.add_argument("--rollout-queue-segment-mib", type=int, default=None, help="straw pack size in MiB")
    g.add_argument("--rollout-io-concurrency", type=int, default=4, help="concurrent straw serialization tasks")
    g.add_argument("--rollout-external-engine-addrs", type=str, nargs="+", default=None,
                   help="addresses of engines started outside this run")
    g.add_argument("--rollout-session-id", type=str, default=None, help="identity of retained internal serving")
    g.add_argument("--rollout-cleanup-timeout", type=float, default=60.0,
                   help="seconds to detach or dispose a training attempt (training recovery)")
    g.add_argument("--rollout-backend", type=str, default="auto", choices=["auto", "sglang", "embedded"],
                   help="engine kind: SGLang servers, or the embedded CPU engine (auto: SGLang when CUDA + sglang)")


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data", "prompt data and batch sizes")
    g.add_argument("--num-rollout", type=int, default=None, help="rollout steps to run")
    g.add_argument("--num-epoch", type=int, default=None,
                   help="derive --num-rollout as epochs x prompts // --rollout-batch-size")
    g.add_argument("--data-source-path", type=str, default=DEFAULT_DATA_SOURCE_PATH,
                   help="class cls(args) handing out prompt groups (get_samples, add_samples, save, load)")
    g.add_argument("--prompt-data", type=str, default=None, help="JSONL (or parquet) file of prompts")
    g.add_argument("--input-key", type=str, default="input", help="record key holding the prompt")
    g.add_argument("--label-key", type=str, default=None, help="record key holding the label given to the reward")
    g.add_argument("--metadata-key", type=str, default="metadata", help="record key of per-sample metadata")
    g.add_argument("--tool-key", type=str, default="tools", help="record key of tool specs for the chat template")
    g.add_argument("--multimodal-keys", type=json.loads, default=None,
                   help="JSON mapping of media types to record keys (multimodal prompts)")
    g.add_argument("--apply-chat-template", action="store_true", default=False,
                   help="the prompt is a chat message list; render it with the tokenizer's chat template")
    g.add_argument("--apply-chat-template-kwargs", type=json.loads, default="{}",
                   help="JSON object of extra keyword arguments for the chat template")
    g.add_argument("--start-rollout-id", type=int, default=None,
                   help="first rollout id (default: the rollout after the last checkpoint under --load, else 0)")
    g.add_argument("--rollout-batch-size", type=int, required=True, help="prompts (groups) per rollout step")
    g.add_argument("--n-samples-per-prompt", type=int, default=1, help="responses generated per prompt (group size)")
    g.add_argument("--num-steps-per-rollout", type=int, default=None,
                   help="optimizer steps per rollout; sets --global-batch-size = rollout samples // this")
    g.add_argument("--balance-data", action="store_true", default=False,
                   help="balance tokens across data-parallel ranks when splitting a step")
    g.add_argument("--balance-by-flops", action="store_true", default=False,
                   help="balance micro-batches by estimated FLOPs instead of tokens")
    g.add_argument("--use-dynamic-batch-size", action="store_true", default=False,
                   help="pack micro-batches up to --max-tokens-per-gpu instead of --micro-batch-size samples")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None, help="token budget of a micro-batch per rank")
    g.add_argument("--log-probs-max-tokens-per-gpu", type=int, default=None,
                   help="token budget per rank of the log-prob passes (default: --max-tokens-per-gpu)")


def _add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("eval", "periodic evaluation")
    g.add_argument("--eval-function-path", type=str, default=None,
                   help="rollout function used for eval (default: --rollout-function-path)")
    g.add_argument("--eval-interval", type=int, default=None, help="evaluate every N rollouts")
    g.add_argument("--eval-prompt-data", type=str, nargs="+", default=None, metavar="NAME PATH",
                   help="pairs of dataset name and path, e.g. aime /data/aime.jsonl")
    g.add_argument("--eval-config", type=str, default=None, help="YAML description of the eval datasets")
    g.add_argument("--skip-eval-before-train", action="store_true", default=False, help="no eval at rollout 0")
    g.add_argument("--eval-input-key", type=str, default=None, help="record key of eval prompts (default: --input-key)")
    g.add_argument("--eval-label-key", type=str, default=None, help="record key of eval labels (default: --label-key)")
    g.add_argument("--eval-tool-key", type=str, default=None, help="record key of eval tool specs (default: --tool-key)")
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1, help="responses generated per eval prompt")
    g.add_argument("--eval-temperature", type=float, default=None, help="eval sampling temperature (default: rollout's)")
    g.add_argument("--eval-top-p", type=float, default=None, help="eval nucleus-sampling mass (default: rollout's)")
    g.add_argument("--eval-top-k", type=int, default=None, help="eval top-k sampling (default: rollout's)")
    g.add_argument("--eval-max-response-len", type=int, default=None,
                   help="most new tokens per eval response (default: --rollout-max-response-len)")
    g.add_argument("--eval-max-prompt-len", type=int, default=None,
                   help="eval prompts with more tokens are skipped (default: as for training prompts)")
    g.add_argument("--eval-min-new-tokens", type=int, default=None, help="fewest new tokens per eval response")
    g.add_argument("--eval-max-context-len", type=int, default=None, help="most prompt + response tokens in eval")


def _add_algorithm_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("algorithm", "RL objective")
    g.add_argument("--advantage-estimator", type=str, default="grpo", choices=ADVANTAGE_ESTIMATORS,
                   help="how rewards become advantages (gspo: GRPO advantages with a sequence-level ratio)")
    g.add_argument("--pg-loss-type", type=str, default=None, choices=["ppo", "reinforce"],
                   help="policy-gradient objective (default: the PPO-clip objective)")
    g.add_argument("--use-score-centering", action="store_true", default=False,
                   help="REINFORCE score-centering objective")
    g.add_argument("--score-centering-top-k", type=int, default=128, help="sampler top-k kept for score centering")
    g.add_argument("--loss-type", type=str, default="policy_loss", choices=LOSS_TYPES,
                   help="policy_loss (PPO-clip), sft_loss (negative log-likelihood), or custom_loss "
                        "(--custom-loss-function-path)")
    g.add_argument("--custom-loss-function-path", type=str, default=None,
                   help="fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics), with --loss-type custom_loss")
    g.add_argument("--disable-compute-advantages-and-returns", action="store_false",
                   dest="compute_advantages_and_returns",
                   help="do not compute advantages/returns (SFT or a custom loss that needs none)")
    g.add_argument("--custom-advantage-function-path", type=str, default=None,
                   help="fn(args, rollout_data) filling rollout_data['advantages'] and ['returns'] in place")
    g.add_argument("--eps-clip", type=float, default=0.2, help="PPO ratio clip below 1 (1 - eps)")
    g.add_argument("--eps-clip-high", type=float, default=None, help="PPO ratio clip above 1 (default: --eps-clip)")
    g.add_argument("--eps-clip-c", type=float, default=None, help="dual-clip bound on negative-advantage losses (> 1)")
    g.add_argument("--value-clip", type=float, default=0.2, help="clip of the critic's value loss (ppo)")
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL-to-reference penalty folded into the rewards")
    g.add_argument("--use-kl-loss", action="store_true", default=False, help="add a KL-to-reference term to the loss")
    g.add_argument("--kl-loss-coef", type=float, default=0.0, help="weight of the KL loss term")
    g.add_argument("--kl-loss-type", type=str, default="k1", choices=KL_LOSS_TYPES,
                   help="KL estimator (k1: log-ratio, k2: squared, k3 / low_var_kl: Schulman's k3)")
    g.add_argument("--use-unbiased-kl", action="store_true", default=False,
                   help="importance-weight the KL estimate by the current/old ratio")
    g.add_argument("--ref-update-interval", type=int, default=None,
                   help="replace the reference model by the actor every N rollouts (default: never)")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="weight of the entropy bonus")
    g.add_argument("--gamma", type=float, default=1.0, help="discount of token rewards (REINFORCE++)")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda of the critic's advantages (ppo)")
    g.add_argument("--normalize-advantages", action="store_true", default=False,
                   help="whiten advantages over every loss token of the rollout")
    g.add_argument("--disable-grpo-std-normalization", action="store_false", dest="grpo_std_normalization",
                   help="GRPO: subtract the group mean only, do not divide by its std (Dr. GRPO)")
    g.add_argument("--disable-rewards-normalization", action="store_false", dest="rewards_normalization",
                   help="use raw rewards as GRPO scores (no group centring)")
    g.add_argument("--use-rollout-entropy", action="store_true", default=False,
                   help="compute entropy in the log-prob passes as well")
    g.add_argument("--use-tis", action="store_true", default=False,
                   help="truncated importance sampling against the engines' log-probs")
    g.add_argument("--tis-clip", type=float, default=2.0, help="upper clip of the TIS ratio")
    g.add_argument("--tis-clip-low", type=float, default=0.0, help="lower clip of the TIS ratio")
    g.add_argument("--use-rollout-logprobs", action="store_true", default=False,
                   help="the engines' log-probs are the old policy (the trainer skips its old-policy forward)")
    g.add_argument("--get-mismatch-metrics", action="store_true", default=False,
                   help="also log train/rollout mismatch metrics (tis, tis_abs, tis_clipfrac, ois); loss unchanged")
    g.add_argument("--custom-tis-function-path", type=str, default=None,
                   help="fn(args=, pg_loss=, train_log_probs=, rollout_log_probs=, loss_masks=, total_lengths=, "
                        "response_lengths=) -> (pg_loss, loss_masks, metrics) replacing TIS (with --use-tis or "
                        "--get-mismatch-metrics)")
    g.add_argument("--custom-pg-loss-reducer-function-path", type=str, default=None,
                   help="fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer of the "
                        "policy-gradient loss (e.g. Dr. GRPO's constant)")
    g.add_argument("--reset-optimizer-states", action="store_true", default=False,
                   help="clear the optimizer state after every rollout")
    g.add_argument("--use-stateless-adam", action="store_true", default=False, help="Adam without moment estimates")
    g.add_argument("--use-opsm", action="store_true", default=False, help="off-policy sequence masking")
    g.add_argument("--opsm-delta", type=float, default=1e-4, help="threshold of off-policy sequence masking")
    g.add_argument("--num-critic-only-steps", type=int, default=0, help="first rollouts that train the critic only")
    g.add_argument("--megatron-config-path", type=str, default=None, help="YAML of per-role (actor/critic) overrides")
    g.add_argument("--calculate-per-token-loss", action="store_true", default=False,
                   help="normalise the loss by the step's loss-token total instead of per sample")


def _add_opd_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("on-policy distillation",
                                  "a per-token reverse-KL penalty towards a teacher, added to the advantages")
    g.add_argument("--use-opd", action="store_true", default=False,
                   help="enable on-policy distillation (needs --opd-type)")
    g.add_argument("--opd-type", type=str, default=None, choices=["sglang", "megatron"],
                   help="sglang: a teacher engine scores each sample (slime.rollout.on_policy_distillation as "
                        "--custom-rm-path / --custom-reward-post-process-path, the engine at --rm-url); megatron: "
                        "the trainer loads the teacher from --opd-teacher-load")
    g.add_argument("--opd-kl-coef", type=float, default=1.0, help="weight of the reverse KL in the advantages")
    g.add_argument("--opd-teacher-load", type=str, default=None,
                   help="teacher checkpoint (megatron or HF directory, the model's architecture) with --opd-type megatron")
    g.add_argument("--opd-teacher-ckpt-step", type=int, default=None,
                   help="iteration of the --opd-teacher-load checkpoint (default: its latest)")


def _check_opd(args: argparse.Namespace) -> None:
    """Upstream's rules for the on-policy distillation flags."""
    if not args.use_opd:
        if args.opd_teacher_load is not None:
            _fail("--opd-teacher-load is set but --use-opd is not; add --use-opd --opd-type megatron")
        if args.opd_type is not None:
            _fail(f"--opd-type {args.opd_type} has no effect without --use-opd; add --use-opd")
        return
    if args.opd_type is None:
        _fail("--use-opd needs --opd-type sglang (a teacher engine) or --opd-type megatron (a teacher checkpoint)")
    if args.opd_type == "megatron":
        if args.opd_teacher_load is None:
            _fail("--opd-type megatron needs --opd-teacher-load DIR (the teacher's checkpoint)")
        _require_path("--opd-teacher-load", args.opd_teacher_load, "checkpoint")
    elif args.opd_teacher_load is not None:
        _fail("--opd-teacher-load is for --opd-type megatron; with --opd-type sglang the teacher engine at --rm-url "
              "scores the samples")
    if args.opd_teacher_ckpt_step is not None and args.opd_type != "megatron":
        _fail("--opd-teacher-ckpt-step picks an iteration of --opd-teacher-load (--opd-type megatron)")
    if args.loss_type != "policy_loss":
        _fail(f"--use-opd shapes the advantages of --loss-type policy_loss; --loss-type {args.loss_type} has none")
    if not args.compute_advantages_and_returns:
        _fail("--use-opd adds its penalty to the advantages: remove --disable-compute-advantages-and-returns")
    if args.custom_advantage_function_path:
        _fail("--use-opd adds its penalty to the built-in advantages, which --custom-advantage-function-path "
              "replaces: drop one of them (or add the teacher term inside the custom function)")


def _add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("reward model", "rewards of generated samples")
    g.add_argument("--rm-type", type=str, default=None,
                   help="built-in reward: math, deepscaler, dapo, f1, gpqa, remote_rm, random (0 or 1 at random, a "
                        "baseline); boxed_<type>: the boxed answer only")
    g.add_argument("--rm-url", type=str, default=None, help="endpoint of --rm-type remote_rm")
    g.add_argument("--reward-key", type=str, default=None, help="key of the reward when the reward is a dict")
    g.add_argument("--eval-reward-key", type=str, default=None, help="--reward-key for eval (default: --reward-key)")
    g.add_argument("--group-rm", action="store_true", default=False, help="reward each group in one call")
    g.add_argument("--custom-rm-path", type=str, default=None,
                   help="async fn(args, sample) -> reward (with --group-rm: fn(args, samples) -> rewards)")
    g.add_argument("--custom-reward-post-process-path", type=str, default=None,
                   help="fn(args, samples) -> (raw rewards, rewards) replacing the GRPO group normalisation")
    g.add_argument("--custom-convert-samples-to-train-data-path", type=str, default=None,
                   help="fn(args, samples) -> dict of per-sample lists (tokens, response_lengths, rewards, raw_reward, "
                        "truncated, sample_indices, loss_masks) replacing the default conversion")


def _add_rollout_buffer_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rollout buffer", "options read by upstream's external rollout-buffer examples")
    g.add_argument("--rollout-buffer-url", type=str, default=None, help="URL of an external rollout buffer")
    g.add_argument("--fetch-trajectory-retry-times", type=int, default=-1,
                   help="retries of a trajectory fetch (-1: unlimited)")
    g.add_argument("--min-batch-collection-ratio", type=float, default=1, help="share of a batch to collect")
    g.add_argument("--rollout-task-type", type=str, default="math", help="task type of the external buffer")
    g.add_argument("--loss-mask-type", type=str, default="qwen", choices=["qwen", "qwen3", "qwen3_5", "distill_qwen"],
                   help="chat format whose assistant turns get loss-mask 1")
    g.add_argument("--data-pad-size-multiplier", type=int, default=128, help="padding multiple of buffer data")


def _add_megatron_model_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron model", "architecture (Megatron-LM names; must agree with the HF config)")
    g.add_argument("--num-layers", type=int, default=None, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=None, help="width of the residual stream")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="width of the MLP (default 4 x hidden)")
    g.add_argument("--num-attention-heads", type=int, default=None, help="query heads per layer")
    g.add_argument("--group-query-attention", action="store_true", default=False,
                   help="grouped-query attention (fewer key/value heads than query heads)")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads with --group-query-attention (default: from the HF config)")
    g.add_argument("--kv-channels", type=int, default=None, help="dimension of each attention head")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="longest sequence the model supports")
    g.add_argument("--position-embedding-type", type=str, default=None,
                   choices=["learned_absolute", "rope", "mrope", "none"],
                   help="kind of position encoding (default: rope, the only one the model builder builds; any "
                        "other is refused)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true", default=False,
                   help="older spelling of --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, default=None, help="RoPE base frequency (default: from the HF config)")
    g.add_argument("--rotary-percent", type=float, default=None,
                   help="share of each head's dimensions rotated by RoPE (default: the HF config's)")
    g.add_argument("--normalization", type=str, default=None, choices=["LayerNorm", "RMSNorm"],
                   help="kind of layer normalisation (default: RMSNorm, the only one the model builder builds; "
                        "LayerNorm is refused)")
    g.add_argument("--norm-epsilon", type=float, default=None, help="epsilon of the norms (default: from the HF config)")
    g.add_argument("--apply-layernorm-1p", action="store_true", default=False,
                   help="norm weights stored as offsets from 1 (zero-centred)")
    g.add_argument("--swiglu", action="store_true", default=False, help="SwiGLU-gated MLP")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="no bias in the linear layers")
    g.add_argument("--add-qkv-bias", action="store_true", default=False, help="bias on the query/key/value projection")
    g.add_argument("--qk-layernorm", action="store_true", default=False, help="normalise queries and keys per head")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=False,
                   help="separate input embedding and output (LM head) weights")
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary size before padding")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP")
    g.add_argument("--padded-vocab-size", type=int, default=None, help="explicit padded vocabulary size")
    g.add_argument("--seq-length", type=int, default=None, help="static sequence length (unused with packing)")
    g.add_argument("--init-method-std", type=float, default=0.02, help="std of the random weight initialisation")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="dropout on attention probabilities")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="dropout on the residual branches")
    g.add_argument("--attention-softmax-in-fp32", action="store_true", default=False,
                   help="compute the attention softmax in fp32")
    g.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion",
                   help="do not fuse masking into the softmax kernel")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion",
                   help="do not fuse bias-add and dropout")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion", help="do not fuse RoPE kernels")
    g.add_argument("--attention-backend", type=str, default="auto", choices=ATTENTION_BACKENDS,
                   help="core attention implementation")
    g.add_argument("--transformer-impl", type=str, default=None, choices=["local", "transformer_engine"],
                   help="layer spec (default: local, the path measured on H200s in benchmarks/RESULTS.md; "
                        "transformer_engine is opt-in, warned as unmeasured, and needs CUDA and TransformerEngine)")
    g.add_argument("--fused-kernels", type=str, default="auto", choices=["auto", "compile", "eager"],
                   help="local spec's RMSNorm, RoPE, SwiGLU and the log-prob/entropy head: compile (torch.compile, "
                        "one kernel each), eager (unfused, the reference), auto (compile on CUDA with Triton, else "
                        "eager)")
    g.add_argument("--use-flash-attn", action="store_true", default=False, help="older Megatron flash-attention switch")
    g.add_argument("--attention-output-gate", "--use-gated-attention", dest="attention_output_gate",
                   action="store_true", default=False,
                   help="gated attention output (Qwen3-Next)")
    g.add_argument("--qwen-gdn-backend", type=str, default="fla", choices=["fla", "flashqla"],
                   help="kernel of Qwen linear-attention (GDN) layers")
    g.add_argument("--freeze-indexer", action="store_true", default=False, help="freeze DSA indexer parameters")
    g.add_argument("--allgather-cp", action="store_true", default=False,
                   help="context-parallel attention by all-gathering K/V (what this project always does)")
    g.add_argument("--mtp-num-layers", type=int, default=None, help="multi-token-prediction layers")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.2, help="weight of the multi-token loss")
    g.add_argument("--enable-mtp-training", action="store_true", default=False, help="train the MTP layers")
    g.add_argument("--bf16", action="store_true", default=False, help="bf16 parameters and compute (default fp32)")
    g.add_argument("--fp16", action="store_true", default=False, help="fp16 parameters and compute")


def _add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron moe", "mixture of experts (megatron-core's MoE layer; the expert "
                                  "count, top-k and widths come from the HF config, a flag must agree with it)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="MLP width of each expert")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None, help="MLP width of the shared expert")
    g.add_argument("--moe-router-topk", type=int, default=None,
                   help="experts each token is routed to (default: the HF config's num_experts_per_tok)")
    g.add_argument("--moe-router-load-balancing-type", type=str, default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"], help="expert load-balancing method")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="weight of the load-balancing loss")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="weight of the router z-loss")
    g.add_argument("--moe-router-score-function", type=str, default=None, choices=["softmax", "sigmoid"],
                   help="router score function (default: the HF config's: softmax for Qwen-MoE, sigmoid for "
                        "DeepSeek-V3); must agree with it")
    g.add_argument("--moe-router-pre-softmax", action="store_true", default=False, help="softmax before top-k")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="scale of the top-k weights (the HF config's routed_scaling_factor; must agree with it)")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="expert groups of group-limited routing (the HF config's n_group; must agree with it)")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="expert groups each token may use (the HF config's topk_group; must agree with it)")
    g.add_argument("--moe-router-dtype", type=str, default=None, choices=["fp32", "fp64"], help="router precision")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true", default=False,
                   help="auxiliary-loss-free balancing bias (DeepSeek-V3's e_score_correction_bias: on whenever the "
                        "HF config has it, refused where it has none)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="update rate of the expert bias after every step (0 keeps the checkpoint's bias)")
    g.add_argument("--moe-token-dispatcher-type", type=str, default="alltoall",
                   choices=["allgather", "alltoall", "flex"], help="how tokens reach their experts")
    g.add_argument("--moe-grouped-gemm", action="store_true", default=False, help="grouped-GEMM expert kernels")
    g.add_argument("--moe-permute-fusion", action="store_true", default=False, help="fused token permutation")
    g.add_argument("--moe-layer-freq", type=str, default=None,
                   help="which layers are MoE (int or python list; default: the HF config's)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None, help="expert capacity factor")
    g.add_argument("--moe-token-drop-policy", type=str, default="probs", choices=["probs", "position"],
                   help="which tokens an over-full expert drops")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true", default=False,
                   help="pad expert inputs to capacity")
    g.add_argument("--moe-shared-expert-overlap", action="store_true", default=False,
                   help="overlap the shared expert with dispatch")
    g.add_argument("--moe-shared-expert-gate", action="store_true", default=False,
                   help="a sigmoid gate on the shared expert's output (must agree with the HF config: Qwen2-MoE has one)")
    g.add_argument("--moe-enable-deepep", action="store_true", default=False,
                   help="DeepEP's token dispatcher (megatron's flex dispatcher)")
    g.add_argument("--use-routing-replay", action="store_true", default=False,
                   help="training forwards route each token to the experts the old-policy log-prob pass chose")
    g.add_argument("--use-rollout-routing-replay", action="store_true", default=False,
                   help="log-prob and training forwards route each token to the experts the rollout engine chose")
    g.add_argument("--routing-replay-prefetch-microbatches", type=int, default=1,
                   help="micro-batches of routing data prefetched (routes are held in memory whole here)")


def _add_model_family_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "model families", "layer spec and attention shape (DeepSeek-V3 MLA, GLM-4 post norms); the model is built "
        "from the HF config and a flag given here must agree with it")
    g.add_argument("--spec", type=str, nargs=2, default=None, metavar=("MODULE", "FUNCTION"),
                   help="layer-spec plug-in: MODULE.FUNCTION(args, config, vp_stage) (or FUNCTION(args)) returns a "
                        "megatron ModuleSpec of one layer or a TransformerBlockSubmodules, e.g. "
                        "slime_plugins.models.glm4 get_glm_spec")
    g.add_argument("--multi-latent-attention", action="store_true", default=False,
                   help="multi-latent attention (DeepSeek-V2/V3, Kimi-K2 configs)")
    g.add_argument("--q-lora-rank", type=int, default=None, help="MLA query latent rank (HF q_lora_rank)")
    g.add_argument("--kv-lora-rank", type=int, default=None, help="MLA key/value latent rank (HF kv_lora_rank)")
    g.add_argument("--qk-head-dim", type=int, default=None,
                   help="MLA query/key head dimension without RoPE (HF qk_nope_head_dim)")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=None,
                   help="MLA query/key RoPE head dimension (HF qk_rope_head_dim)")
    g.add_argument("--v-head-dim", type=int, default=None, help="MLA value head dimension (HF v_head_dim)")
    g.add_argument("--rotary-scaling-factor", type=float, default=None, help="YaRN RoPE scaling factor (HF factor)")
    g.add_argument("--mscale", type=float, default=None, help="YaRN attention mscale (HF mscale)")
    g.add_argument("--mscale-all-dim", type=float, default=None, help="YaRN mscale_all_dim (HF mscale_all_dim)")
    g.add_argument("--rotary-interleaved", action="store_true", default=False,
                   help="RoPE rotates interleaved dimension pairs (GLM-4) instead of halves")
    g.add_argument("--post-self-attn-layernorm", action="store_true", default=False,
                   help="a norm on the self-attention output before the residual add (GLM-4)")
    g.add_argument("--post-mlp-layernorm", action="store_true", default=False,
                   help="a norm on the MLP output before the residual add (GLM-4)")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="no learned absolute position embedding (older Megatron spelling)")


def _add_upstream_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron (more)", "other Megatron flags upstream's launchers pass")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers of the first pipeline stage (the others split the rest evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers of the last pipeline stage (the others split the rest evenly)")
    g.add_argument("--fp8-format", type=str, default=None, choices=["e4m3", "hybrid"],
                   help="FP8 number format of TransformerEngine's FP8 training")
    g.add_argument("--fp8-recipe", type=str, default=None, choices=["tensorwise", "delayed", "mxfp8", "blockwise"],
                   help="FP8 scaling recipe of TransformerEngine's FP8 training")
    g.add_argument("--enable-experimental", action="store_true", default=False,
                   help="megatron-core's experimental features")
    g.add_argument("--deterministic-mode", action="store_true", default=False,
                   help="deterministic kernels and collectives")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
                   help="no fused weight-gradient accumulation kernel")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad", help="do not check the loss and gradients for NaN")


def _add_megatron_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron parallel", "model parallelism and activation recomputation")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="tensor-parallel (TP) ranks that split each layer's weights")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline-parallel (PP) stages that split the layers")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="context-parallel (CP) ranks that split each sequence")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="expert-parallel (EP) ranks (MoE)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="tensor-parallel ranks of each expert (default: --tensor-model-parallel-size)")
    g.add_argument("--sequence-parallel", action="store_true", default=False,
                   help="split norms and dropout along the sequence over the TP group (SP)")
    g.add_argument("--use-distributed-optimizer", action="store_true", default=False,
                   help="shard the optimizer state over data-parallel ranks")
    g.add_argument("--overlap-grad-reduce", action="store_true", default=False,
                   help="overlap the data-parallel gradient reduce with backward")
    g.add_argument("--overlap-param-gather", action="store_true", default=False,
                   help="overlap the distributed optimizer's parameter gather with forward")
    g.add_argument("--recompute-granularity", type=str, default=None, choices=["full", "selective"],
                   help="recompute activations in backward to save memory")
    g.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"],
                   help="how layers are grouped for full recomputation")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="layers per recomputation unit")


def _add_megatron_training_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron optimizer/training", "optimizer, schedule and batch")
    g.add_argument("--train-backend", type=str, default="megatron", choices=["megatron"], help="training backend")
    g.add_argument("--micro-batch-size", type=int, default=1, help="samples per micro-batch (static batching)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step (default: a whole rollout, or set by --num-steps-per-rollout)")
    g.add_argument("--optimizer", type=str, default="adam", choices=["adam", "sgd"],
                   help="optimizer of the training step (adam only here)")
    g.add_argument("--lr", type=float, default=1e-6, help="learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="floor of the decayed learning rate")
    g.add_argument("--lr-decay-style", type=str, default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   help="learning-rate schedule after warm-up")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="optimizer steps of the decay (default: --train-iters)")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="optimizer steps of linear warm-up")
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="warm-up as a share of the decay steps")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="learning rate at the start of warm-up")
    g.add_argument("--train-iters", type=int, default=None, help="total optimizer steps the schedule is laid out for")
    g.add_argument("--weight-decay", type=float, default=0.01, help="decoupled weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam's first-moment decay")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam's second-moment decay")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam's denominator epsilon")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum")
    g.add_argument("--clip-grad", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true", default=False,
                   help="keep and reduce gradients in fp32")
    g.add_argument("--use-precision-aware-optimizer", action="store_true", default=False,
                   help="TransformerEngine's precision-aware Adam")
    g.add_argument("--optimizer-cpu-offload", action="store_true", default=False, help="keep the optimizer state on CPU")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true", default=False,
                   help="overlap the CPU optimizer's copies")
    g.add_argument("--only-train-params-name-list", type=str, nargs="*", default=None,
                   help="regexes of parameter names to train; every other parameter is frozen")
    g.add_argument("--freeze-params-name-list", type=str, nargs="*", default=None,
                   help="regexes of parameter names to freeze")
    g.add_argument("--recompute-loss-function", action="store_true", default=False,
                   help="recompute the loss in backward to save memory")
    g.add_argument("--force-fp8-ue8m0-scale", action="store_true", default=False,
                   help="quantize block-FP8 rollout weights with power-of-two scales")
    g.add_argument("--log-probs-chunk-size", type=int, default=-1,
                   help="tokens per chunk of the log-prob computation (-1: one chunk)")
    g.add_argument("--seed", type=int, default=1234, help="seed of weight init, dropout and sampling")


def _add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoint", "Megatron and HF checkpoints")
    g.add_argument("--ref-load", type=str, default=None,
                   help="reference-model weights: HF directory or Megatron checkpoint (default: --hf-checkpoint)")
    g.add_argument("--ref-ckpt-step", type=int, default=None,
                   help="iteration of the --ref-load Megatron checkpoint to use (default: its latest)")
    g.add_argument("--load", type=str, default=None, help="resume from this Megatron checkpoint directory")
    g.add_argument("--save", type=str, default=None, help="save Megatron checkpoints under this directory")
    g.add_argument("--save-interval", type=int, default=None, help="save every N rollouts (needs --save)")
    g.add_argument("--async-save", action="store_true", default=False, help="save checkpoints in the background")
    g.add_argument("--no-save-optim", action="store_true", default=False,
                   help="save model weights without the optimizer state")
    g.add_argument("--no-load-optim", action="store_true", default=False,
                   help="resume model weights but start a fresh optimizer")
    g.add_argument("--no-load-rng", action="store_true", default=False,
                   help="do not restore the saved RNG states on --load (every rank starts from --seed)")
    g.add_argument("--allow-fresh-data-position", action="store_true", default=False,
                   help="--load without the saved data position (rollout/global_dataset_state_dict_N.pt): start "
                        "from the first prompt instead of failing")
    g.add_argument("--finetune", action="store_true", default=False,
                   help="load --load's weights only and start at rollout 0 with a fresh optimizer")
    g.add_argument("--ckpt-format", type=str, default="torch_dist", choices=["torch", "torch_dist"],
                   help="checkpoint format")
    g.add_argument("--save-hf", "--save-hf-path", dest="save_hf", type=str, default=None,
                   help="also save HF safetensors weights at every checkpoint to this path ('{rollout_id}' is filled in)")
    g.add_argument("--custom-model-provider-path", type=str, default=None,
                   help="fn(pre_process, post_process, vp_stage) -> GPTModel replacing the model builder")


def _add_sglang_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "sglang",
        "SGLang engines. Any --sglang-<server-arg> is passed to SGLang's ServerArgs (validated against it when sglang "
        "is importable) and collected in args.sglang_server_args; the common ones are listed here.",
    )
    g.add_argument("--sglang-mem-fraction-static", type=float, default=None,
                   help="share of GPU memory for weights and KV cache")
    g.add_argument("--sglang-cuda-graph-bs", type=int, nargs="+", default=None,
                   help="batch sizes captured as CUDA graphs")
    g.add_argument("--sglang-server-concurrency", type=int, default=512,
                   help="requests in flight per engine from the rollout")


def _add_router_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("router", "request routing over engines")
    g.add_argument("--use-slime-router", action="store_true", default=False,
                   help="use this project's router instead of sglang-router")
    g.add_argument("--sglang-router-ip", type=str, default=None, help="address of a running router (default: start one)")
    g.add_argument("--sglang-router-port", type=int, default=None, help="port of the router")
    g.add_argument("--sglang-router-request-timeout-secs", type=int, default=14400,
                   help="seconds one /generate request may take")
    g.add_argument("--sglang-router-policy", type=str, default=None,
                   help="sglang-router load-balancing policy (default: round_robin)")


def _add_tracking_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("wandb/tensorboard", "experiment tracking")
    g.add_argument("--use-wandb", action="store_true", default=False, help="log to Weights & Biases")
    g.add_argument("--wandb-project", type=str, default=None, help="Weights & Biases project name")
    g.add_argument("--wandb-group", type=str, default=None, help="Weights & Biases run group")
    g.add_argument("--wandb-key", type=str, default=None, help="Weights & Biases API key")
    g.add_argument("--wandb-host", type=str, default=None, help="Weights & Biases server URL")
    g.add_argument("--wandb-team", type=str, default=None, help="Weights & Biases entity (team)")
    g.add_argument("--wandb-mode", type=str, default=None, choices=["online", "offline", "disabled"],
                   help="Weights & Biases mode")
    g.add_argument("--wandb-dir", type=str, default=None, help="local directory of Weights & Biases files")
    g.add_argument("--wandb-run-id", type=str, default=None, help="resume this Weights & Biases run")
    g.add_argument("--disable-wandb-random-suffix", action="store_false", dest="wandb_random_suffix",
                   help="no random suffix on the Weights & Biases run name")
    g.add_argument("--wandb-always-use-train-step", action="store_true", default=False,
                   help="use the optimizer step as the Weights & Biases x-axis for every metric")
    g.add_argument("--log-multi-turn", action="store_true", default=False, help="log multi-turn rollout statistics")
    g.add_argument("--log-passrate", action="store_true", default=False, help="log pass@k of the rollout")
    g.add_argument("--log-reward-category", type=str, default=None,
                   help="reward-dict key whose values are counted per rollout")
    g.add_argument("--log-correct-samples", action="store_true", default=False, help="log the correct responses")
    g.add_argument("--use-tensorboard", action="store_true", default=False, help="log to TensorBoard")
    g.add_argument("--tensorboard-dir", type=str, default=None, help="TensorBoard log directory (Megatron's name)")
    g.add_argument("--tb-project-name", type=str, default=None, help="TensorBoard log directory (upstream's name)")
    g.add_argument("--tb-experiment-name", type=str, default=None,
                   help="TensorBoard run name: a sub-directory of the TensorBoard log dir")


def _add_debug_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("debug", "reproduce train-phase problems without engines")
    g.add_argument("--save-debug-rollout-data", type=str, default=None,
                   help="save every rollout's samples to this path ('{rollout_id}' template)")
    g.add_argument("--load-debug-rollout-data", type=str, default=None,
                   help="train on saved rollouts instead of generating (implies --debug-train-only)")
    g.add_argument("--load-debug-rollout-data-subsample", type=float, default=None,
                   help="share of each saved rollout to replay")
    g.add_argument("--load-forge-rollout-data", type=str, default=None,
                   help="replay saved rollouts while the engines stay live")
    g.add_argument("--save-debug-train-data", type=str, default=None,
                   help="save the train batch (with log-probs and advantages) per rollout ('{rollout_id}', '{rank}')")
    g.add_argument("--dump-details", type=str, default=None,
                   help="directory for both the rollout and the train data of every rollout")
    g.add_argument("--debug-train-only", action="store_true", default=False, help="no engines; train only")
    g.add_argument("--debug-rollout-only", action="store_true", default=False, help="no training; rollout only")
    g.add_argument("--check-weight-update-equal", action="store_true", default=False,
                   help="compare the engines' weights with the trainer's after a sync")
    g.add_argument("--memory-snapshot-dir", type=str, default=".", help="directory of memory snapshots")
    g.add_argument("--memory-snapshot-num-steps", type=int, default=None, help="steps recorded in a memory snapshot")
    g.add_argument("--memory-recorder", type=str, default="torch", choices=["torch", "memray"],
                   help="memory recorder")
    g.add_argument("--record-memory-history", action="store_true", default=False, help="record allocation history")
    g.add_argument("--http-proxy", type=str, default=None, help="proxy for the rollout's HTTP requests")
    g.add_argument("--use-distributed-post", action="store_true", default=False,
                   help="spread rollout HTTP requests over Ray workers")
    g.add_argument("--ci-test", action="store_true", default=False, help="upstream CI assertions")
    g.add_argument("--ci-disable-kl-checker", action="store_true", default=False, help="skip upstream's CI KL check")
    g.add_argument("--ci-train-rollout-logprob-abs-diff-threshold", type=float, default=0.1,
                   help="upstream CI bound on train/train_rollout_logprob_abs_diff")
    g.add_argument("--ci-save-grad-norm", type=str, default=None, help="file to save grad norms to (CI)")
    g.add_argument("--ci-load-grad-norm", type=str, default=None, help="file of grad norms to compare with (CI)")


def _add_custom_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron plug-ins", "functions called on every training rank")
    g.add_argument("--custom-megatron-init-path", type=str, default=None,
                   help="fn(args) called once after megatron's process groups and RNG are set up")
    g.add_argument("--custom-megatron-before-log-prob-hook-path", type=str, default=None,
                   help="fn(args, model, store_prefix) before each log-prob pass ('' actor, 'ref_' reference)")
    g.add_argument("--custom-megatron-before-train-step-hook-path", type=str, default=None,
                   help="fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler) before each step")
    g.add_argument("--megatron-deepgemm-forward-layers", type=int, nargs="+", default=None,
                   help="layers whose linears use TransformerEngine's DeepGEMM forward")
    g.add_argument("--megatron-deepgemm-forward-modules", type=str, nargs="+", default=None,
                   help="module-name suffixes replaced in those layers")
    g.add_argument("--megatron-deepgemm-moe-forward-layers", type=int, nargs="+", default=None,
                   help="MoE layers using the grouped DeepGEMM forward")
    g.add_argument("--megatron-deepgemm-moe-forward-modules", type=str, nargs="+", default=None,
                   help="MoE module-name suffixes replaced in those layers")


# upstream flag -> its argparse keywords; what each does here is its registry entry (warned or refused)
_UPSTREAM_COMPAT_FLAGS: dict[str, dict[str, Any]] = {
    "--keep-old-actor": dict(action="store_true"),
    "--profile-target": dict(type=str, default=None), "--use-pytorch-profiler": dict(action="store_true"),
    "--profile": dict(action="store_true"), "--profile-step-start": dict(type=int, default=None),
    "--profile-step-end": dict(type=int, default=None), "--profile-ranks": dict(type=int, nargs="+", default=None),
    "--train-memory-margin-bytes": dict(type=int, default=None), "--disable-weights-backuper": dict(action="store_true"),
    "--megatron-to-hf-mode": dict(type=str, default="raw", choices=["raw", "bridge"]),
    "--qkv-format": dict(type=str, default="thd", choices=["thd", "bshd"]),
    "--eval-num-gpus": dict(type=int, default=None), "--log-throughput": dict(action="store_true"),
    "--log-timers-to-tensorboard": dict(action="store_true"), "--tensorboard-log-interval": dict(type=int, default=None),
    "--log-params-norm": dict(action="store_true"), "--timing-log-level": dict(type=int, default=None),
    "--save-retain-interval": dict(type=int, default=None), "--keep-checkpoint-num": dict(type=int, default=None),
    "--sglang-config": dict(type=str, default=None), "--prefill-num-servers": dict(type=int, default=None),
    "--slime-router-middleware-paths": dict(type=str, nargs="+", default=None),
    "--custom-update-weight-post-write-path": dict(type=str, default=None),
    "--true-on-policy-mode": dict(action="store_true"), "--use-dynamic-global-batch-size": dict(action="store_true"),
    "--critic-num-nodes": dict(type=int, default=None), "--critic-num-gpus-per-node": dict(type=int, default=None),
    "--critic-load": dict(type=str, default=None), "--critic-save": dict(type=str, default=None),
    "--critic-lr": dict(type=float, default=None), "--critic-lr-warmup-iters": dict(type=int, default=None),
    "--rollout-external": dict(action="store_true"), "--ckpt-step": dict(type=int, default=None),
    "--exit-interval": dict(type=int, default=None), "--no-save-rng": dict(action="store_true"),
    "--update-weight-disk-dir": dict(type=str, default=None),
    "--update-weight-disk-keep-files": dict(type=int, default=None),
    "--update-weight-local-checkpoint-dir": dict(type=str, default=None),
    "--update-weight-delta-encoding": dict(type=str, default=None),
    "--update-weight-delta-checksum": dict(action="store_true"),
}


def _registry_help(flag: str) -> str:
    for entry in REFUSED_FLAGS:
        if entry.flag == flag:
            return f"upstream's flag; refused here: {entry.reason}"
    for entry in NOT_IMPLEMENTED_FLAGS:
        if entry.flag == flag:
            return f"upstream's flag; no effect here (warned): {entry.reason}"
    if flag in ALWAYS_HONOURED_FLAGS:
        return f"upstream's flag; always true here: {ALWAYS_HONOURED_FLAGS[flag]}"
    return "upstream's flag (its registry entry says what it does here)"  # registries replaced (tests)


def _add_upstream_compat_arguments(parser: argparse.ArgumentParser) -> None:
    """Upstream slime's remaining non-model flags: two implemented, the rest warned or refused with the reason."""
    g = parser.add_argument_group("upstream compatibility", "upstream slime flags, with what they do here")
    g.add_argument("--disable-rollout-global-dataset", action="store_false", dest="rollout_global_dataset",
                   help="do not load --prompt-data into the data source; a custom --rollout-function-path (or "
                        "--data-source-path) supplies the prompts")
    g.add_argument("--log-interval", type=int, default=1, help="write each rank's loss line every N rollouts")
    for flag, kwargs in _UPSTREAM_COMPAT_FLAGS.items():
        g.add_argument(flag, help=_registry_help(flag), **kwargs)


def _add_fencing_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fencing (this project)", "hang-proof training step")
    g.add_argument("--fence-timeout", type=float, default=600.0,
                   help="seconds a rank may go without progress (no collective, micro-batch, weight bucket or "
                        "checkpoint bytes completing) before the step fails with a report; phases may run longer")
    g.add_argument("--recreate-process-groups-on-wake", action="store_true", default=False,
                   help="destroy and re-create communicators across colocate sleep (default: keep them alive)")
    g.add_argument("--single-rank-group-max-ctas", type=int, default=1,
                   help="NCCL channels of a communicator whose group holds one rank (it moves no bytes; NCCL's "
                        "usual channels cost ~0.4 GiB each outside the allocator, kept while asleep); 0: as many as "
                        "NCCL picks")
    g.add_argument("--train-backend-device", type=str, default="auto", choices=["auto", "cpu", "cuda"],
                   help="device of the training ranks (auto: cuda when available)")
    g.add_argument("--metrics-jsonl", type=str, default=None, help="append one JSON line of metrics per event here")
    g.add_argument("--verbose", action="store_true", default=False,
                   help="print every metrics event on stdout as `[kind k] key=value ...`, the placement of every "
                        "bundle and every rank's Python warnings (default: one line per rollout; every event "
                        "still goes to --metrics-jsonl, wandb and TensorBoard)")
    g.add_argument("--ledger-dir", type=str, default=None,
                   help="directory for per-rank collective ledgers and stall reports (default: a temp dir, removed "
                        "after a run that ends cleanly and kept, with its path printed, after a failure)")
    g.add_argument("--custom-config-path", type=str, default=None,
                   help="YAML mapping of flag overrides (flag or attribute names; unknown keys become attributes "
                        "for plug-ins); applied over the command line")
    g.add_argument("--ledger-record-sequence", action="store_true", default=False,
                   help="also write every rank's whole sequence of fences and collectives to "
                        "<ledger-dir>/sequence_rank<N>.jsonl (check: python -m slime.distributed.order_proof DIR)")


def _add_security_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("security", "who may call the run's engines and router (slime/utils/security.py)")
    g.add_argument("--api-key", type=str, default=None,
                   help="the run's API key, required as 'Authorization: Bearer <key>' on every route of every engine "
                        "and router the run starts (SGLang's --api-key is set to it); default: $SLIME_API_KEY, else "
                        "a random key made at start. Never logged")


def _add_rollout_fault_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rollout deadlines and fault tolerance", "bounded waits on the engines")
    g.add_argument("--rollout-timeout", type=float, default=None,
                   help="seconds one rollout (or eval) may take before it fails naming the engines and the requests "
                        "outstanding (default: 300 + 0.1 x max new tokens x ceil(samples / (engines x "
                        "--sglang-server-concurrency)); samples = max(--rollout-batch-size, "
                        "--over-sampling-batch-size) x --n-samples-per-prompt; max new tokens = "
                        "--rollout-max-response-len, else --rollout-max-context-len, else 4096; eval: every eval "
                        "prompt x --n-samples-per-eval-prompt and --eval-max-response-len)")
    g.add_argument("--use-fault-tolerance", action="store_true", default=False,
                   help="probe the engines while they generate; restart a dead or unresponsive one, push it the "
                        "trainer's weights and send its requests again (without: a failed engine ends the run)")
    g.add_argument("--rollout-health-check-interval", type=float, default=10.0,
                   help="seconds between two health probes of every engine (with --use-fault-tolerance)")
    g.add_argument("--rollout-health-check-timeout", type=float, default=5.0,
                   help="seconds an engine's /health_generate may take before it counts as failed "
                        "(with --use-fault-tolerance)")
    g.add_argument("--rollout-health-check-first-wait", type=float, default=300.0,
                   help="seconds before the first health probe of a run, e.g. for model compilation "
                        "(with --use-fault-tolerance)")


ARGUMENT_GROUPS: tuple[Callable[[argparse.ArgumentParser], None], ...] = (
    _add_cluster_arguments,
    _add_rollout_arguments,
    _add_data_arguments,
    _add_eval_arguments,
    _add_algorithm_arguments,
    _add_opd_arguments,
    _add_reward_arguments,
    _add_rollout_buffer_arguments,
    _add_megatron_model_arguments,
    _add_moe_arguments,
    _add_model_family_arguments,
    _add_upstream_megatron_arguments,
    _add_megatron_parallel_arguments,
    _add_megatron_training_arguments,
    _add_checkpoint_arguments,
    _add_sglang_arguments,
    _add_router_arguments,
    _add_rollout_fault_arguments,
    _add_tracking_arguments,
    _add_debug_arguments,
    _add_custom_megatron_arguments,
    _add_fencing_arguments,
    _add_security_arguments,
    _add_upstream_compat_arguments,
)

# Hook-path flags checked for an importable module when the user sets them.
FUNCTION_PATH_FLAGS: tuple[str, ...] = (
    "--rollout-function-path",
    "--custom-generate-function-path",
    "--eval-function-path",
    "--dynamic-sampling-filter-path",
    "--buffer-filter-path",
    "--data-source-path",
    "--rollout-sample-filter-path",
    "--rollout-all-samples-process-path",
    "--custom-rollout-log-function-path",
    "--custom-eval-rollout-log-function-path",
    "--rollout-data-postprocess-path",
    "--custom-rm-path",
    "--custom-reward-post-process-path",
    "--custom-convert-samples-to-train-data-path",
    "--custom-loss-function-path",
    "--custom-advantage-function-path",
    "--custom-tis-function-path",
    "--custom-pg-loss-reducer-function-path",
    "--custom-model-provider-path",
    "--custom-megatron-init-path",
    "--custom-megatron-before-log-prob-hook-path",
    "--custom-megatron-before-train-step-hook-path",
)


class SlimeArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line usage on errors: the message naming the bad flag stays visible."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n(run with --help for the list of flags)\n")


# Flags a run cannot do without, marked [required] in --help: --rollout-batch-size is checked by parse_args,
# --hf-checkpoint by check_launch_inputs before Ray starts (so that the parser's own tests work without it); a
# missing one is named together with every other missing flag.
REQUIRED_FLAGS: tuple[str, ...] = ("--hf-checkpoint", "--rollout-batch-size")

HELP_EPILOG = """\
This project's own flags (hang-proof step) are in the groups "fencing (this project)" and "rollout faults":
--fence-timeout, --ledger-dir, --ledger-record-sequence, --distributed-timeout-minutes, --use-fault-tolerance.
Where every rank is in a running or stopped job: python -m slime.distributed.hang_report LEDGER_DIR
Whether every rank ran the same collectives in the same order: python -m slime.distributed.order_proof LEDGER_DIR
Marks: [required] must be given; [refused] stops at parse time with the reason; [no effect] accepted with a
warning, changes nothing; [always on] asks for what this project always does."""


def registry_mark(flag: str) -> str:
    """How a flag's help line starts: what the registries say of it ('' for an ordinary flag)."""
    if flag in REQUIRED_FLAGS:
        return "[required] "
    for entry in REFUSED_FLAGS:
        if entry.flag == flag:
            return "[refused: some values] " if entry.is_active else f"[refused: {entry.reason}] "
    for entry in NOT_IMPLEMENTED_FLAGS:
        if entry.flag == flag:
            return f"[no effect: {entry.reason}] "
    if flag in ALWAYS_HONOURED_FLAGS:
        return f"[always on: {ALWAYS_HONOURED_FLAGS[flag]}] "
    return ""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every flag's help line starts with its registry mark and ends with its default, once."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings:
            return text
        text = registry_mark(action.option_strings[0]) + text
        refused_values = [e.reason for e in REFUSED_FLAGS if e.flag == action.option_strings[0] and e.is_active]
        if refused_values:
            text += f" (refused values: {'; '.join(refused_values)})"
        if (action.default is argparse.SUPPRESS or "%(default)" in text or "default" in text.lower()
                or action.option_strings[0] in REQUIRED_FLAGS):
            return text
        return f"{text} (default: %(default)s)"

    def _format_text(self, text: str) -> str:
        # The epilog keeps its lines (one command per line); the description is one paragraph.
        return text + "\n" if text and "\n" in text else super()._format_text(text)


def closest_flags(flag: str, parser: argparse.ArgumentParser, n: int = 3) -> list[str]:
    """Known flags that look like a mistyped one."""
    return difflib.get_close_matches(flag, list(parser._option_string_actions), n=n, cutoff=0.6)


def unknown_flags_message(flags: Sequence[str], parser: argparse.ArgumentParser) -> str:
    described = []
    for flag in flags:
        close = closest_flags(flag, parser)
        described.append(f"{flag} (did you mean {' or '.join(close)}?)" if close else flag)
    return "unrecognized arguments: " + "; ".join(described)


def unknown_flags_report(argv: Sequence[str], unknown: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """The refusals and no-effect warnings of argv's known flags, then every unknown flag with did-you-mean."""
    lenient = copy.deepcopy(parser)
    for action in lenient._actions:
        action.required = False
    try:
        known, _ = lenient.parse_known_args(list(argv))
    except SystemExit:  # a known flag's own value is malformed: report the unknown ones alone
        return unknown_flags_message(unknown, parser)
    device = resolve_train_device(known)
    parts = [f"refused: {m}" for m in refusal_messages(known, parser, device)]
    parts += [f"accepted without effect: {e.flag} ({e.reason})"
              for e in active_not_implemented_flags(known, parser, device)]
    return "\n".join([*parts, unknown_flags_message(unknown, parser)])


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
        formatter_class=DefaultsHelpFormatter,
        epilog=HELP_EPILOG,
    )
    if add_custom_arguments is not None:
        parser = add_custom_arguments(parser) or parser
    for add_group in ARGUMENT_GROUPS:
        add_group(parser)
    return parser


# --------------------------------------------------------------------------------------------------------------
# Validation: derived values first, then cross-flag checks. Each check is a short function raising with a fix.
# --------------------------------------------------------------------------------------------------------------
MODEL_FAMILIES = ("qwen3", "qwen2", "llama", "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4")


def _fail(message: str) -> None:
    raise ArgumentValidationError(message)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _derive(args: argparse.Namespace, dest: str, value: Any, how: str) -> None:
    """Set a value the user did not pass, remembering how it was derived (for error messages)."""
    setattr(args, dest, value)
    args.derived_values[dest] = how


def _named(args: argparse.Namespace, dest: str) -> str:
    """'--flag value', with where the value came from when the user did not pass it."""
    how = args.derived_values.get(dest)
    text = f"{_flag(dest)} {getattr(args, dest)}"
    return text if how is None else f"{text} (not passed: {how})"


def _check_positive(args: argparse.Namespace) -> None:
    for dest in ("rollout_batch_size", "n_samples_per_prompt", "actor_num_nodes", "actor_num_gpus_per_node",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size", "rollout_num_gpus_per_engine", "micro_batch_size", "log_interval"):
        if getattr(args, dest) <= 0:
            _fail(f"{_flag(dest)} must be positive, got {getattr(args, dest)}")
    if args.fence_timeout <= 0:
        _fail(f"--fence-timeout must be positive seconds, got {args.fence_timeout}")
    if args.rollout_temperature <= 0:
        _fail("--rollout-temperature must be > 0 (0 is greedy decoding, not a valid RL policy)")
    if args.max_tokens_per_gpu is not None and args.max_tokens_per_gpu <= 0:
        _fail(f"--max-tokens-per-gpu must be positive, got {args.max_tokens_per_gpu}")


def _check_deadlines(args: argparse.Namespace) -> None:
    """Process-group timeouts strictly above every watchdog window (slime/utils/deadlines.py)."""
    if args.distributed_timeout_minutes is not None and args.distributed_timeout_minutes <= 0:
        _fail(f"--distributed-timeout-minutes must be positive, got {args.distributed_timeout_minutes}")
    problem = DeadlineModel.from_args(args).group_timeout_error()
    if problem:
        _fail(problem)
    if args.distributed_timeout_minutes is None:
        args.distributed_timeout_minutes = default_group_timeout_minutes(args.fence_timeout)


# What the model builder always builds (model.py: every supported family's HF config has RMSNorm and RoPE).
BUILT_NORMALIZATION, BUILT_POSITION_EMBEDDING = "RMSNorm", "rope"


def _resolve_architecture_kinds(args: argparse.Namespace) -> None:
    """--normalization / --position-embedding-type describe the model: a value the builder would not build is
    refused; left out, they say what it builds (plug-ins read them)."""
    if args.use_rotary_position_embeddings:
        if args.position_embedding_type not in (None, BUILT_POSITION_EMBEDDING):
            _fail(f"--use-rotary-position-embeddings contradicts --position-embedding-type "
                  f"{args.position_embedding_type}; drop one")
        args.position_embedding_type = BUILT_POSITION_EMBEDDING
    if args.normalization not in (None, BUILT_NORMALIZATION):
        _fail(f"--normalization {args.normalization}: the model builder builds {BUILT_NORMALIZATION} layers only "
              f"(the norm of every supported family's HF config); pass --normalization {BUILT_NORMALIZATION} or "
              "drop the flag")
    if args.position_embedding_type not in (None, BUILT_POSITION_EMBEDDING):
        _fail(f"--position-embedding-type {args.position_embedding_type}: the model builder builds rotary position "
              f"embeddings (RoPE, from the HF config's rope parameters) only; pass --position-embedding-type "
              f"{BUILT_POSITION_EMBEDDING} or drop the flag")
    if args.normalization is None:
        _derive(args, "normalization", BUILT_NORMALIZATION, "what the model builder builds")
    if args.position_embedding_type is None:
        _derive(args, "position_embedding_type", BUILT_POSITION_EMBEDDING, "what the model builder builds")


def _resolve_model_defaults(args: argparse.Namespace) -> None:
    _resolve_architecture_kinds(args)
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.bf16 and args.fp16:
        _fail("--bf16 and --fp16 are mutually exclusive; pass one")
    if args.eps_clip_high is None:
        _derive(args, "eps_clip_high", args.eps_clip, f"--eps-clip {args.eps_clip}")
    if args.padded_vocab_size is not None and args.vocab_size is not None and args.padded_vocab_size < args.vocab_size:
        _fail(f"--padded-vocab-size {args.padded_vocab_size} is smaller than --vocab-size {args.vocab_size}")
    if args.model_name is not None and args.model_name.lower() not in MODEL_FAMILIES:
        _fail(f"--model-name {args.model_name} is not supported; the model builder converts {', '.join(MODEL_FAMILIES)}")


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
    _check_pipeline_layers(args)


def _check_pipeline_layers(args: argparse.Namespace) -> None:
    """The layers the middle stages split evenly: --num-layers minus the first/last stage's own counts."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if (first is not None or last is not None) and pp == 1:
        _fail("--decoder-first/last-pipeline-num-layers set the layers of pipeline stages: add "
              "--pipeline-model-parallel-size > 1 or drop them")
    if layers is None:
        return
    middle, stages = layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
    if middle < 0 or (stages == 0 and middle) or (stages and middle % stages):
        given = " ".join(f"{_flag(d)} {getattr(args, d)}" for d in
                         ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers") if getattr(args, d))
        _fail(f"--num-layers {layers} does not split over --pipeline-model-parallel-size {pp}"
              f"{' with ' + given if given else ''}: the remaining {middle} layers must divide evenly over the "
              f"other {stages} stage(s)")


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
    _check_expert_layout(args, world)
    args.actor_world_size = world
    args.world_size = world
    _derive(args, "data_parallel_size", world // model_parallel,
            f"actor world {world} / (--tensor-model-parallel-size {tp} x --context-parallel-size {cp} x "
            f"--pipeline-model-parallel-size {pp})")
    if args.sequence_parallel and tp == 1:
        warnings.warn("--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabling it", stacklevel=4)
        args.sequence_parallel = False


def _check_expert_layout(args: argparse.Namespace, world: int) -> None:
    """EP x ETP x PP must tile the world; EP must divide the experts; top-k at most the experts."""
    ep, etp, pp = args.expert_model_parallel_size, args.expert_tensor_parallel_size, args.pipeline_model_parallel_size
    if world % (ep * etp * pp):
        _fail(f"actor world size {world} is not divisible by --expert-model-parallel-size {ep} x "
              f"--expert-tensor-parallel-size {etp} x --pipeline-model-parallel-size {pp} = {ep * etp * pp}; "
              "pick EP and ETP whose product with PP divides the actor GPU count")
    experts, topk = args.num_experts, args.moe_router_topk
    if experts is not None and experts % ep:
        _fail(f"--expert-model-parallel-size {ep} does not divide --num-experts {experts}; use a divisor of {experts}")
    if experts is not None and topk is not None and topk > experts:
        _fail(f"--moe-router-topk {topk} is above --num-experts {experts}; route each token to at most {experts} experts")


def _check_batching(args: argparse.Namespace) -> None:
    if args.use_dynamic_batch_size:
        if args.max_tokens_per_gpu is None:
            _fail("--use-dynamic-batch-size needs --max-tokens-per-gpu (the per-rank token budget of a micro-batch)")
        if args.log_probs_max_tokens_per_gpu is None:
            _derive(args, "log_probs_max_tokens_per_gpu", args.max_tokens_per_gpu,
                    f"--max-tokens-per-gpu {args.max_tokens_per_gpu}")
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    rollout = f"--rollout-batch-size {args.rollout_batch_size} x --n-samples-per-prompt {args.n_samples_per_prompt}"
    if args.num_steps_per_rollout is not None:
        steps = args.num_steps_per_rollout
        if steps <= 0 or samples % steps:
            _fail(f"--num-steps-per-rollout {steps} must be positive and divide the rollout's {samples} samples "
                  f"({rollout})")
        if args.global_batch_size is not None and args.global_batch_size != samples // steps:
            _fail(f"--global-batch-size {args.global_batch_size} contradicts --num-steps-per-rollout {steps} "
                  f"({rollout} // {steps} = {samples // steps}); pass only one of them")
        _derive(args, "global_batch_size", samples // steps, f"{rollout} // --num-steps-per-rollout {steps}")
    elif args.global_batch_size is None:
        logger.info("--global-batch-size not set: one optimizer step per rollout (%d samples)", samples)
        _derive(args, "global_batch_size", samples, f"one step per rollout = {rollout}")
    gbs = args.global_batch_size
    if gbs <= 0 or samples % gbs:
        _fail(f"the rollout's {samples} samples ({rollout}) are not a multiple of {_named(args, 'global_batch_size')}")
    args.num_steps_per_rollout = samples // gbs


def _check_batch_split(args: argparse.Namespace) -> None:
    """Every DP rank must get the same number of samples (and static micro-batches) per step."""
    gbs, dp = args.global_batch_size, args.data_parallel_size
    dp_text = f"data-parallel size {dp} (= {args.derived_values['data_parallel_size']})"
    if gbs % dp:
        _fail(f"{_named(args, 'global_batch_size')} is not divisible by the {dp_text}")
    if not args.use_dynamic_batch_size and gbs % (args.micro_batch_size * dp):
        _fail(f"{_named(args, 'global_batch_size')} is not divisible by --micro-batch-size {args.micro_batch_size} "
              f"x {dp_text}; fix the sizes or use --use-dynamic-batch-size")


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
    if args.eval_config is not None:  # upstream: the config replaces --eval-prompt-data
        _require_path("--eval-config", args.eval_config, "file")
        try:
            args.eval_datasets = load_eval_config(args.eval_config)
        except ValueError as exc:
            _fail(str(exc))
        args.eval_prompt_data = [item for spec in args.eval_datasets for item in (spec.name, spec.path)]
        return
    values = list(args.eval_prompt_data or [])
    if len(values) == 1:
        logger.info("--eval-prompt-data given one path; naming the dataset 'aime' as upstream does")
        values = ["aime", values[0]]
    if len(values) % 2:
        _fail(f"--eval-prompt-data takes NAME PATH pairs; got {len(values)} values: {values}")
    args.eval_datasets = tuple(EvalDatasetSpec(values[i], values[i + 1]) for i in range(0, len(values), 2))
    args.eval_prompt_data = values or None
    if args.eval_interval is not None and not args.eval_datasets:
        _fail("--eval-interval needs --eval-prompt-data NAME PATH [NAME PATH ...] (or --eval-config FILE)")


def _check_paths(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.hf_checkpoint is not None:
        _require_path("--hf-checkpoint", args.hf_checkpoint, "directory")
        config_path = os.path.join(args.hf_checkpoint, HF_CONFIG_FILE)
        if os.path.isfile(config_path):  # its absence is check_launch_inputs' to name
            _check_hf_config(args, config_path)
    if args.prompt_data is not None and not args.debug_train_only:
        _require_path("--prompt-data", args.prompt_data, "file")
        if args.data_source_path == DEFAULT_DATA_SOURCE_PATH:
            _check_prompt_rows(args.prompt_data, "--prompt-data", args.input_key, args.label_key)
    eval_flag = "--eval-config" if args.eval_config else "--eval-prompt-data"
    for spec in args.eval_datasets:
        _require_path(f"{eval_flag} {spec.name}", spec.path, "file")
        if args.eval_function_path == DEFAULT_ROLLOUT_FUNCTION_PATH:  # the keys as eval_prompt_specs reads them
            _check_prompt_rows(spec.path, f"{eval_flag} {spec.name}",
                               spec.input_key or args.eval_input_key or args.input_key,
                               spec.label_key or args.eval_label_key or args.label_key)
    if args.load_debug_rollout_data is not None:
        path = args.load_debug_rollout_data
        if "{rollout_id}" in path:  # a per-rollout template: its directory must exist
            _require_path("--load-debug-rollout-data", os.path.dirname(path) or ".", "directory")
        else:
            _require_path("--load-debug-rollout-data", path, "file")
    if args.ref_load is not None and (args.use_kl_loss or args.kl_coef != 0):
        _require_path("--ref-load", args.ref_load, "checkpoint")
    for flag in (*FUNCTION_PATH_FLAGS, "--rollout-sample-hook-path"):
        dest = parser._option_string_actions[flag].dest
        value = getattr(args, dest)
        if value is None or value == parser.get_default(dest):
            continue
        for path in value if isinstance(value, list) else [value]:
            _check_hook_path(flag, path)


def _check_prompt_rows(path: str, flag: str, input_key: str, label_key: str | None) -> None:
    """A JSONL prompt file: every line a JSON object holding --input-key (and --label-key when set); the first
    bad line is named by file and line number. Parquet files are checked when the data source loads them."""
    from slime.rollout.prompt_rows import check_prompt_rows

    try:
        check_prompt_rows(path, flag, input_key, label_key)
    except ValueError as exc:
        _fail(str(exc))


def _check_hook_path(flag: str, path: str) -> None:
    """A hook must resolve to a callable now, not in a Ray actor minutes after start-up."""
    try:
        findable = module_is_findable(path)
    except ValueError as exc:  # not of the form pkg.module.func / file.py:func
        _fail(f"{flag}: {exc}")
    except Exception as exc:  # noqa: BLE001 - a parent package that raised while it was imported
        _fail(f"{flag}: importing the module of {path!r} failed: {import_failure(exc)}")
    if not findable:
        raise MissingPathError(f"{flag}: cannot find the module of {path!r} (expected 'pkg.module.func' or "
                               "'file.py:func')")
    try:
        hook = load_function(path)
    except AttributeError as exc:
        _fail(f"{flag}: {exc}")
    except Exception as exc:  # noqa: BLE001 - whatever the module raised at import: one line, no traceback
        _fail(f"{flag}: importing the module of {path!r} failed: {import_failure(exc)}")
    if not callable(hook):
        _fail(f"{flag}: {path!r} is a value of type {type(hook).__name__}, not a function or class")


def import_failure(exc: BaseException) -> str:
    """'FILE:LINE: Type: message' of an exception raised while a hook module was imported: the line of the
    hook's own code (or of what it imported) that raised, not the import machinery's."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}: {type(exc).__name__}: {exc.msg}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")
              and os.path.abspath(f.filename) != os.path.abspath(__file__)
              and not f.filename.endswith(os.path.join("slime", "utils", "misc.py"))]
    where = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    return f"{where}{type(exc).__name__}: {exc}"


# What an HF checkpoint directory must hold for the trainer (config) and the engines and data (tokenizer).
HF_CONFIG_FILE = "config.json"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def launch_missing_flags(args: argparse.Namespace) -> list[str]:
    """Flags a launch cannot do without, each as 'FLAG is required: why', for those not given."""
    missing = []
    if not args.hf_checkpoint:
        missing.append("--hf-checkpoint DIR is required: the Hugging Face checkpoint (config.json and tokenizer) "
                       "the trainer builds its model from and the engines serve")
    reads_prompts = (getattr(args, "data_source_path", DEFAULT_DATA_SOURCE_PATH) == DEFAULT_DATA_SOURCE_PATH
                     and getattr(args, "rollout_function_path", None) == DEFAULT_ROLLOUT_FUNCTION_PATH
                     and not getattr(args, "debug_train_only", False))
    if reads_prompts and not getattr(args, "prompt_data", None):
        missing.append("--prompt-data FILE is required: the prompts (JSONL or parquet) the default rollout "
                       "generates from")
    return missing


def check_launch_inputs(args: argparse.Namespace) -> None:
    """What a launch needs before Ray starts, beyond what parse_args checks: the flags only a launch needs
    (all of them named at once) and the HF checkpoint."""
    missing = launch_missing_flags(args)
    if missing:
        _fail("; ".join(missing))
    path = args.hf_checkpoint
    _require_path("--hf-checkpoint", path, "directory")
    if not os.path.isfile(os.path.join(path, HF_CONFIG_FILE)):
        _fail(f"--hf-checkpoint {path}: no {HF_CONFIG_FILE} (is it a Hugging Face checkpoint directory?)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in HF_TOKENIZER_FILES):
        _fail(f"--hf-checkpoint {path}: no tokenizer (none of {', '.join(HF_TOKENIZER_FILES)})")
    _check_moe_tensor_parallel(args, os.path.join(path, HF_CONFIG_FILE))


MOE_CONFIG_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")

# HF model_type values the model builder has a family for (docs/model-families.md). Any other checkpoint would be
# built as a dense Qwen3/Llama and fail later, on the ranks, when its weights do not fit.
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "kimi_k2",
                         "glm4")
# Megatron flag dest -> the HF config key that gives the same number (the model is built from the config).
CONFIG_ARCH_KEYS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
                    "num_attention_heads": "num_attention_heads", "ffn_hidden_size": "intermediate_size",
                    "num_query_groups": "num_key_value_heads"}


def _read_hf_config(config_path: str) -> dict:
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        _fail(f"--hf-checkpoint: {config_path} is not readable JSON ({exc})")
    if not isinstance(config, dict):
        _fail(f"--hf-checkpoint: {config_path} holds a JSON {type(config).__name__}, not an object")
    return config


def _check_hf_config(args: argparse.Namespace, config_path: str) -> None:
    """The checkpoint's config.json against the model builder and the architecture flags, before Ray starts."""
    if args.debug_rollout_only:
        return  # no trainer model is built
    config = _read_hf_config(config_path)
    model_type = config.get("model_type")
    custom_builder = args.spec or args.custom_model_provider_path
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES and not custom_builder:
        _fail(f"--hf-checkpoint: {config_path} has model_type {model_type!r}, which no model family here builds "
              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}; docs/model-families.md); a --spec or "
              "--custom-model-provider-path plug-in may build others")
    heads = config.get("num_attention_heads")
    mla = model_type in ("deepseek_v3", "deepseek_v2", "kimi_k2") and config.get("kv_lora_rank") is not None
    arch = {dest: config.get(key) for dest, key in CONFIG_ARCH_KEYS.items()}
    arch["num_query_groups"] = heads if mla else (config.get("num_key_value_heads") or heads)
    for dest, value in arch.items():
        given = getattr(args, dest)
        if given is not None and value is not None and given != value:
            _fail(f"{_flag(dest)} {given} contradicts {config_path} ({CONFIG_ARCH_KEYS[dest]} = {value}); the model "
                  f"is built from the config: drop the flag or pass {_flag(dest)} {value}")
    tp = args.tensor_model_parallel_size
    if isinstance(heads, int) and heads % tp:
        _fail(f"--tensor-model-parallel-size {tp} does not divide the model's {heads} attention heads "
              f"(num_attention_heads in {config_path}); pick a TP size that divides {heads}")
    groups = arch["num_query_groups"]
    if isinstance(groups, int) and groups % tp:
        _fail(f"--tensor-model-parallel-size {tp} does not divide the model's {groups} key/value heads "
              f"(num_key_value_heads in {config_path}; megatron-core splits them over TP without replicating); "
              f"pick a TP size that divides {groups}")
    layers, pp = config.get("num_hidden_layers"), args.pipeline_model_parallel_size
    if args.num_layers is None and isinstance(layers, int) and pp > 1:
        args.num_layers = layers
        try:
            _check_pipeline_layers(args)
        finally:
            args.num_layers = None


def _check_moe_tensor_parallel(args: argparse.Namespace, config_path: str) -> None:
    """megatron-core trains an MoE layer at TP > 1 only with sequence parallelism; say so before Ray starts
    rather than at the first training forward."""
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        _fail(f"--hf-checkpoint: {config_path} is not readable JSON ({exc})")
    moe = any(int(config.get(key) or 0) > 0 for key in MOE_CONFIG_KEYS) or int(args.num_experts or 0) > 0
    if moe and args.tensor_model_parallel_size > 1 and not args.sequence_parallel and not args.debug_rollout_only:
        _fail(f"the checkpoint is an MoE model and --tensor-model-parallel-size is "
              f"{args.tensor_model_parallel_size}: megatron-core trains MoE layers at TP > 1 only with "
              "--sequence-parallel; add it (or use --expert-model-parallel-size instead of TP)")


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
    if args.colocate and args.actor_num_nodes > 1:
        _fail(f"--colocate with --actor-num-nodes {args.actor_num_nodes}: colocated engines take their weights "
              "from a trainer rank on their own host (CUDA IPC or shared memory), which this project does on one "
              "node only; across nodes drop --colocate and give the engines their own GPUs (--rollout-num-gpus N)")
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
    args.start_rollout_id_given = args.start_rollout_id is not None  # else train.py reads it from --load
    if args.finetune and args.load is None:
        _fail("--finetune loads the weights of --load DIR; pass --load")
    if args.dump_details is not None:  # upstream: both debug dumps under one directory
        _derive(args, "save_debug_rollout_data", f"{args.dump_details}/rollout_data/{{rollout_id}}.pt",
                f"--dump-details {args.dump_details}")
        _derive(args, "save_debug_train_data", f"{args.dump_details}/train_data/{{rollout_id}}.pt",
                f"--dump-details {args.dump_details}")


def _resolve_rollout_defaults(args: argparse.Namespace) -> None:
    if args.num_rollout is None and args.num_epoch is None:
        _fail("set --num-rollout N (rollout steps) or --num-epoch N")
    if args.over_sampling_batch_size is not None and args.over_sampling_batch_size < args.rollout_batch_size:
        _fail(f"--over-sampling-batch-size {args.over_sampling_batch_size} must be >= --rollout-batch-size "
              f"{args.rollout_batch_size}")
    if args.mask_offpolicy_in_partial_rollout and not args.partial_rollout:
        _fail("--mask-offpolicy-in-partial-rollout only acts on resumed samples: add --partial-rollout")
    if args.eval_function_path is None:
        _derive(args, "eval_function_path", args.rollout_function_path, "--rollout-function-path")
    if args.eval_reward_key is None:
        args.eval_reward_key = args.reward_key
    _check_rm_type(args)
    if args.n_samples_per_prompt == 1:
        args.grpo_std_normalization = False  # a group of one has no spread to divide by
    if args.rollout_max_context_len is not None:
        if args.rollout_max_prompt_len is None:
            args.rollout_max_prompt_len = args.rollout_max_context_len - 1
        if args.rollout_max_prompt_len > args.rollout_max_context_len - 1:
            _fail(f"--rollout-max-prompt-len {args.rollout_max_prompt_len} leaves no room to generate within "
                  f"--rollout-max-context-len {args.rollout_max_context_len}")


def _check_rollout_faults(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.rollout_timeout is not None and args.rollout_timeout <= 0:
        _fail(f"--rollout-timeout must be positive, got {args.rollout_timeout}")
    for dest in ("rollout_health_check_interval", "rollout_health_check_timeout"):
        if getattr(args, dest) <= 0:
            _fail(f"--{dest.replace('_', '-')} must be positive, got {getattr(args, dest)}")
    if args.rollout_health_check_first_wait < 0:
        _fail(f"--rollout-health-check-first-wait must be >= 0, got {args.rollout_health_check_first_wait}")
    health = ("rollout_health_check_interval", "rollout_health_check_timeout", "rollout_health_check_first_wait")
    changed = [f"--{d.replace('_', '-')}" for d in health if getattr(args, d) != parser.get_default(d)]
    if changed and not args.use_fault_tolerance:
        warnings.warn(f"{', '.join(changed)} only take effect with --use-fault-tolerance", stacklevel=4)


def _resolve_tracking(args: argparse.Namespace) -> None:
    if args.tensorboard_dir is None and args.tb_project_name is not None:
        args.tensorboard_dir = args.tb_project_name  # upstream slime's name for the TensorBoard dir


def _check_rm_type(args: argparse.Namespace) -> None:
    if args.rm_type is None or args.custom_rm_path is not None:
        return
    from slime.rollout.rm_hub import RM_TYPES

    base = args.rm_type[len("boxed_"):] if args.rm_type.startswith("boxed_") else args.rm_type
    if base not in RM_TYPES:
        close = difflib.get_close_matches(base, RM_TYPES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        _fail(f"--rm-type {args.rm_type} is not a built-in reward{hint}; choose one of {', '.join(RM_TYPES)} "
              "(optionally boxed_<type>) or pass --custom-rm-path")


def _check_plugins(args: argparse.Namespace) -> None:
    """Plug-in flags that would silently do nothing without their companion flag."""
    if args.loss_type == "custom_loss" and not args.custom_loss_function_path:
        _fail("--loss-type custom_loss needs --custom-loss-function-path pkg.module.fn")
    if args.custom_loss_function_path and args.loss_type != "custom_loss":
        _fail("--custom-loss-function-path is used with --loss-type custom_loss only; add it")
    if args.custom_tis_function_path and not (args.use_tis or args.get_mismatch_metrics):
        _fail("--custom-tis-function-path replaces TIS: add --use-tis (or --get-mismatch-metrics, as upstream)")
    if args.only_train_params_name_list and args.freeze_params_name_list:
        _fail("pass one of --only-train-params-name-list and --freeze-params-name-list, not both")
    if args.ref_update_interval is not None and not (args.use_kl_loss or args.kl_coef):
        _fail("--ref-update-interval refreshes the reference model, which only --use-kl-loss or --kl-coef use")


def _check_algorithm(args: argparse.Namespace) -> None:
    if args.kl_coef != 0 and args.kl_loss_coef != 0:
        _fail("--kl-coef (reward shaping) and --kl-loss-coef (loss term) cannot both be non-zero; pick one")
    if args.advantage_estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline") \
            and not args.normalize_advantages:
        _fail(f"--advantage-estimator {args.advantage_estimator} requires --normalize-advantages")
    if args.save_interval is not None and args.save is None:
        _fail("--save-interval needs --save DIR")
    if args.save_hf and not (args.save and args.save_interval):
        _fail("--save-hf is written with each checkpoint: add --save DIR --save-interval N")


def _check_rollout_backend(args: argparse.Namespace) -> None:
    """Resolve --rollout-backend once at parse time, so a choice that cannot work fails before start-up."""
    if args.debug_train_only:  # no engines
        return
    from slime.backends.sglang_utils.launcher import pick_rollout_backend

    try:
        pick_rollout_backend(args)
    except ValueError as exc:
        raise ArgumentValidationError(str(exc)) from None


def _check_logprob_mismatch(args: argparse.Namespace) -> None:
    """Engine vs trainer log-probs: both must mean the same distribution."""
    from slime.backends.embedded_engine.sampling import RETURN_ORIGINAL_LOGPROB_ENV, return_original_logprob

    if args.use_rollout_logprobs and args.use_tis:
        _fail("--use-rollout-logprobs and --use-tis cannot be combined: TIS corrects the trainer's old policy "
              "towards the engines', which --use-rollout-logprobs already uses; drop one")
    if return_original_logprob() and args.rollout_temperature != 1.0:
        # The engines then report temperature-1 log-probs while the trainer's are at the rollout temperature.
        message = (f"{RETURN_ORIGINAL_LOGPROB_ENV} is set: engines return log-probs before the rollout temperature "
                   f"({args.rollout_temperature:g}), the trainer's are after it")
        if args.use_rollout_logprobs or args.use_tis:
            _fail(f"{message}; --use-rollout-logprobs / --use-tis would mix the two distributions. "
                  f"Unset {RETURN_ORIGINAL_LOGPROB_ENV} or use --rollout-temperature 1")
        warnings.warn(f"{message}: train/train_rollout_logprob_abs_diff compares different distributions",
                      stacklevel=4)


def _check_weight_sync(args: argparse.Namespace) -> None:
    if args.update_weight_mode != "full":
        _fail(f"--update-weight-mode {args.update_weight_mode} is not implemented; drop it (full weights are sent)")
    if args.update_weight_transport != "nccl":
        _fail(f"--update-weight-transport {args.update_weight_transport} is not implemented; drop it (engines "
              "get tensors when colocated and a broadcast group otherwise)")


# Upstream's layer-spec plug-ins whose layers this project does not have (a --spec naming one is refused).
UNSUPPORTED_SPEC_MODULES: dict[str, str] = {
    "slime_plugins.models.qwen3_5": "Qwen3.5 gated delta-net and gated-attention layers are not implemented",
    "slime_plugins.models.qwen3_5_vl": "Qwen3.5-VL (vision and gated delta-net layers) is not implemented",
    "slime_plugins.models.qwen3_next": "Qwen3-Next gated delta-net and gated-attention layers are not implemented",
    "slime_plugins.models.glm5": "GLM-5's sparse (DSA indexer) attention layers are not implemented",
    "slime_plugins.models.glm5.glm5": "GLM-5's sparse (DSA indexer) attention layers are not implemented",
    "slime_plugins.models.minimax_m2": "MiniMax-M2's layers are not implemented",
}


def _check_spec(args: argparse.Namespace) -> None:
    """--spec MODULE FUNCTION must name a function now, not when the training ranks build the model."""
    if not args.spec:
        return
    module, function = args.spec
    if module in UNSUPPORTED_SPEC_MODULES:
        _fail(f"--spec {module} {function} is not supported here: {UNSUPPORTED_SPEC_MODULES[module]}; the layer "
              "specs here are the built-in ones (dense, MoE, MLA from the HF config) and slime_plugins.models.glm4 "
              "get_glm_spec")
    _check_hook_path("--spec", f"{module}.{function}")


def _check_ledger(args: argparse.Namespace) -> None:
    if args.ledger_record_sequence and not args.ledger_dir:
        _fail("--ledger-record-sequence needs --ledger-dir DIR (where the sequence files are kept)")


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None,
                  device: str = "cpu") -> argparse.Namespace:
    """Fill derived values and check flag combinations in place; raises ArgumentValidationError with the fix."""
    parser = parser or build_parser()
    args.derived_values = {}
    refuse_unsupported(args, parser, device)
    _check_positive(args)
    _check_deadlines(args)
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
    _check_logprob_mismatch(args)
    _check_weight_sync(args)
    _check_plugins(args)
    _check_opd(args)
    _check_spec(args)
    _check_ledger(args)
    _check_rollout_faults(args, parser)
    _resolve_tracking(args)
    _resolve_eval_datasets(args)
    _check_paths(args, parser)
    return args


def _check_required(args: argparse.Namespace, required: Sequence[argparse.Action]) -> None:
    """Every flag the run cannot do without, named in one error: the parser's required ones, --num-rollout or
    --num-epoch, and, when any of those is missing, what the launch will need too (check_launch_inputs)."""
    missing = [f"{action.option_strings[0]} is required: {action.help}" for action in required
               if getattr(args, action.dest) is None]
    if args.num_rollout is None and args.num_epoch is None:
        missing.append("--num-rollout N (rollout steps) or --num-epoch N is required")
    if missing:
        _fail("; ".join([*missing, *launch_missing_flags(args)]))


def _config_dest(key: str, parser: argparse.ArgumentParser) -> str | None:
    """The dest a --custom-config-path key names: '--flag-name', 'flag-name' or the attribute 'flag_name'."""
    for option in (key, "--" + key.lstrip("-"), "--" + key.lstrip("-").replace("_", "-")):
        if option in parser._option_string_actions:
            return parser._option_string_actions[option].dest
    dests = {action.dest for action in parser._actions}
    return key if key in dests else None


def _coerce(action: argparse.Action, value: Any) -> Any:
    # YAML leaves e.g. 1e-5 a string; convert it the way the flag's own type would
    convert = action.type if callable(action.type) and action.type is not json.loads else None
    if convert is None:
        return value
    if isinstance(value, list):
        return [convert(v) if isinstance(v, str) else v for v in value]
    return convert(value) if isinstance(value, str) else value


def apply_custom_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """--custom-config-path: a YAML mapping whose values override the command line (upstream's semantics).

    Keys naming a flag (as '--flag-name', 'flag-name' or 'flag_name') override it before validation, so
    derived values and checks see them; any other key becomes an attribute for plug-ins (custom functions).
    """
    path = args.custom_config_path
    if not path:
        return {}
    import yaml

    _require_path("--custom-config-path", path, "file")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        _fail(f"--custom-config-path {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    applied = {}
    for key, value in data.items():
        dest = _config_dest(str(key), parser)
        if dest is None:
            if not str(key).isidentifier():
                _fail(f"--custom-config-path {path}: key {key!r} is neither a flag nor a valid attribute name")
            dest = str(key)
        else:
            action = next(a for a in parser._actions if a.dest == dest)
            value = _coerce(action, value)
        if hasattr(args, dest):
            logger.info("--custom-config-path %s: %s = %r (was %r)", path, dest, shown(dest, value),
                        shown(dest, getattr(args, dest)))
        setattr(args, dest, value)
        applied[dest] = shown(dest, value)  # kept with args: no secret in it
    return applied


def parse_args(
    argv: Sequence[str] | None = None,
    add_custom_arguments: Callable[[argparse.ArgumentParser], argparse.ArgumentParser | None] | None = None,
) -> argparse.Namespace:
    """Parse ``argv`` (default: sys.argv[1:]), apply --custom-config-path, validate, and warn about
    accepted-but-unimplemented flags.

    Unknown flags (answered with the closest known ones), refused flags and invalid combinations exit
    with status 2 and a message naming the flags.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(add_custom_arguments)
    known_sglang = sglang_passthrough.registered_sglang_flags(parser)
    remaining, passthrough = sglang_passthrough.split_passthrough(argv, known_sglang)
    # Unknown flags before argparse (which would report a missing required flag instead), after what the
    # registries say of the known ones: an upstream job learns why its refused flags cannot run first.
    unknown = [a.split("=", 1)[0] for a in remaining
               if a.startswith("--") and a.split("=", 1)[0] not in parser._option_string_actions]
    if unknown:
        parser.error(unknown_flags_report(remaining, unknown, parser))
    required = [action for action in parser._actions if action.required]
    for action in required:  # checked below with every other missing flag, so that one run names them all
        action.required = False
    try:
        args = parser.parse_args(remaining)
    finally:
        for action in required:
            action.required = True
    try:
        args.custom_config_overrides = apply_custom_config(args, parser)
        _check_required(args, required)
        try:  # once, in the driver: every server of the run gets it
            args.api_key = resolve_api_key(args.api_key)
        except ValueError as exc:
            raise ArgumentValidationError(f"--api-key: {exc}") from None
        args.sglang_server_args = sglang_passthrough.resolve_server_args(args, passthrough)
        device = resolve_train_device(args)
        validate_args(args, parser, device)
        _check_rollout_backend(args)
    except (ArgumentValidationError, sglang_passthrough.SGLangArgumentError) as exc:
        parser.error(str(exc))
    args.not_implemented_flags = tuple(warn_not_implemented(args, parser, device))
    return args


if __name__ == "__main__":  # `python -m slime.utils.arguments --help` shows the flags without train.py
    print(parse_args())
