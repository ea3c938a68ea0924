"""What upstream flags do here: the registries of refused, no-effect and always-on flags.

An entry applies when the user's value makes it active (default: differs from the parser default) and the
resolved train device is in its ``devices``. Refused flags stop parsing with the reason; no-effect flags are
accepted with one warning each; always-on flags ask for what this project always does.
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from slime.config.errors import NotImplementedFlagWarning, fail


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
    applies: Callable[[argparse.Namespace], bool] | None = None
    """Predicate on the other flags (the reason then names them); None means 'whatever they are'."""


def _warned(reason: str, *flags: str) -> tuple[NotImplementedFlag, ...]:
    return tuple(NotImplementedFlag(flag=flag, reason=reason) for flag in flags)


NOT_IMPLEMENTED_FLAGS: tuple[NotImplementedFlag, ...] = (
    NotImplementedFlag(
        flag="--use-precision-aware-optimizer", applies=lambda a: not a.optimizer_cpu_offload,
        reason="without --optimizer-cpu-offload, only TransformerEngine's FusedAdam holds such state in megatron, and "
               "this project does not use it: megatron's optimizer keeps the fp32 master weights and torch's AdamW the "
               "moments, the same update (TE would keep 16 bit remainders instead, 2 bytes a parameter less)"),
    *(NotImplementedFlag(flag=flag, applies=lambda a: not a.optimizer_cpu_offload,
                         reason="only meaningful with --optimizer-cpu-offload")
      for flag in ("--overlap-cpu-optimizer-d2h-h2d", "--optimizer-offload-fraction")),
    NotImplementedFlag(
        flag="--attention-backend",
        reason="flash/fused/unfused need TransformerEngine; the local/plugin attention is used",
        is_active=lambda v: v not in ("auto", "local"),
    ),
    NotImplementedFlag(flag="--use-flash-attn", reason="flash-attn is not used; attention follows --attention-backend"),
    *_warned("this wandb option is not wired (project, group and key are)", "--wandb-host", "--wandb-team",
             "--wandb-mode", "--wandb-dir", "--wandb-run-id", "--disable-wandb-random-suffix",
             "--wandb-always-use-train-step"),
    *_warned("gradients are reduced at a fixed place of the step (finalize_model_grads), never overlapped",
             "--overlap-grad-reduce", "--overlap-param-gather"),
    *_warned("a memory/speed option of upstream's loss code; log-probs are computed in one pass",
             "--log-probs-chunk-size", "--recompute-loss-function"),
    *_warned("FP8 rollout weights are not implemented (weights are sent in the training dtype)",
             "--force-fp8-ue8m0-scale"),
    *_warned("FlashQLA kernels are not available here; the gated delta rule runs flash-linear-attention's kernel "
             "where it is installed and trusted, else the project's compiled or eager torch path (docs/gpu.md)",
             "--qwen-gdn-backend"),
    *_warned("the straw rollout transport is not available (rollouts travel through the Ray object store)",
             "--rollout-data-dir", "--rollout-storage-profile", "--rollout-storage-declaration",
             "--rollout-queue-run-id", "--rollout-queue-online-gc", "--rollout-queue-lease-seconds",
             "--rollout-queue-segment-mib", "--rollout-io-concurrency"),
    NotImplementedFlag(flag="--rollout-session-id",
                       reason="no engines outlive the driver: a resubmitted run starts its own; --load resumes at "
                              "another parallel layout (docs/exact-resume.md, 'Resuming at another layout')"),
    NotImplementedFlag(flag="--rollout-cleanup-timeout",
                       reason="every teardown step has a deadline of its own (slime/utils/deadlines.py); nothing "
                              "is retained between attempts to detach"),
    *_warned("FLOPs-balanced micro-batches are not implemented; --balance-data balances tokens",
             "--balance-by-flops"),
    *_warned("eval requests are bounded by --eval-max-response-len and --rollout-max-context-len",
             "--eval-max-context-len"),
    *_warned("checkpoints are saved synchronously", "--async-save"),
    *_warned("replayed routes of a step are held in memory whole; nothing is prefetched",
             "--routing-replay-prefetch-microbatches"),
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
             "--data-pad-size-multiplier"),
    *_warned("upstream's SFT rollout picks a chat format's loss-mask rule with it; here the SFT loss mask follows "
             "the tokenizer's own chat template, whatever the format (slime/utils/mask_utils.py)", "--loss-mask-type"),
    *_warned("TransformerEngine DeepGEMM forwards are not used", "--megatron-deepgemm-forward-layers",
             "--megatron-deepgemm-forward-modules", "--megatron-deepgemm-moe-forward-layers",
             "--megatron-deepgemm-moe-forward-modules"),
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
    *_warned("no second retention schedule: --keep-checkpoint-num keeps the newest N checkpoints",
             "--save-retain-interval"),
    *_warned("a delta is applied to the weights the engine holds in memory (over the broadcast group): no "
             "host-local checkpoint is kept", "--update-weight-local-checkpoint-dir"),
)


# Flags that ask for what this project always does: accepted, read by nobody, and that is correct.
ALWAYS_HONOURED_FLAGS: dict[str, str] = {
    "--swiglu": "the dense builder always builds the HF config's SwiGLU MLP",
    "--disable-bias-linear": "linear layers get no bias beyond the q/k/v biases of the families whose HF config has "
                             "them (Qwen2, GLM-4: what --add-qkv-bias asks for)",
    "--attention-softmax-in-fp32": "megatron-core computes the attention softmax in fp32 by default",
    "--no-masked-softmax-fusion": "fused softmax kernels are always off (they are CUDA-only)",
    "--no-bias-dropout-fusion": "bias-dropout fusion is always off",
    "--no-rope-fusion": "RoPE fusion is always off",
    "--allgather-cp": "context-parallel attention always all-gathers K/V over the CP group",
    "--train-backend": "megatron-core is the only training backend",
    "--no-gradient-accumulation-fusion": "gradient-accumulation fusion (a CUDA kernel) is always off",
    "--no-position-embedding": "no learned absolute position embedding is ever added; positions are the HF "
                               "config's RoPE",
    "--check-weight-update-equal": "the weight-sync proof compares a digest of every tensor the engines serve with "
                                   "what was pushed, after every push (off only with --no-weight-sync-proof)",
}


REFUSED_FLAGS: tuple[NotImplementedFlag, ...] = (
    NotImplementedFlag(
        flag="--optimizer-cpu-offload", applies=lambda a: not a.use_precision_aware_optimizer,
        reason="without --use-precision-aware-optimizer, the hybrid optimizer of megatron core 0.16 updates copies of "
               "the distributed optimizer's fp32 main weights, which are never refreshed from loaded weights (the "
               "first step would return to the initialisation, not to the weights of --hf-checkpoint) and which it "
               "cannot load back from a checkpoint; add --use-precision-aware-optimizer, as upstream's launchers do"),
    NotImplementedFlag(flag="--optimizer", is_active=lambda v: v != "adam", reason="only --optimizer adam is implemented"),
    NotImplementedFlag(flag="--pg-loss-type", is_active=lambda v: v == "reinforce",
                       reason="the REINFORCE objective is not implemented (the PPO-clip objective is)"),
    NotImplementedFlag(flag="--use-score-centering", reason="score centering is not implemented"),
    NotImplementedFlag(flag="--score-centering-top-k", reason="score centering is not implemented"),
    NotImplementedFlag(flag="--use-unbiased-kl", reason="the importance-weighted (unbiased) KL is not implemented"),
    NotImplementedFlag(flag="--use-opsm", reason="off-policy sequence masking is not implemented"),
    NotImplementedFlag(flag="--opsm-delta", reason="off-policy sequence masking is not implemented"),
    NotImplementedFlag(flag="--reset-optimizer-states", reason="resetting optimizer state per rollout is not implemented"),
    NotImplementedFlag(flag="--use-stateless-adam", reason="stateless Adam is not implemented"),
    *(NotImplementedFlag(flag=f, reason="FP8 training needs TransformerEngine's FP8 layers, which this model builder "
                                        "does not use; drop it to train in bf16 (--bf16) or fp32")
      for f in ("--fp8-format", "--fp8-recipe")),
    *(NotImplementedFlag(flag=f, reason="weights reach the engines only over CUDA IPC, shared memory or the "
                                        "distributed group (--update-weight-transport), never through files on disk")
      for f in ("--update-weight-disk-dir", "--update-weight-disk-keep-files")),
    NotImplementedFlag(flag="--update-weight-transport", is_active=lambda v: v == "disk",
                       reason="weights reach the engines only over CUDA IPC, shared memory or the distributed group, "
                              "never through files on disk; --update-weight-transport nccl (the default) carries "
                              "--update-weight-mode delta too"),
    NotImplementedFlag(flag="--update-weight-mode", is_active=lambda v: v == "sparse",
                       reason="sparse weight updates are not implemented; --update-weight-mode delta sends only the "
                              "changed positions"),
    NotImplementedFlag(flag="--release-train", reason="releasing the train actors needs disk weight sync, not implemented"),
    NotImplementedFlag(flag="--flush-cache-interval", is_active=lambda v: v != 1,
                       reason="the engines' cache is flushed at every weight sync; a longer interval is not implemented"),
    NotImplementedFlag(flag="--rollout-data-transport", is_active=lambda v: v != "object-store",
                       reason="only the Ray object store carries rollouts here"),
    NotImplementedFlag(flag="--rollout-external-engine-addrs",
                       reason="external engines are not supported; the rollout manager launches its own"),
    NotImplementedFlag(flag="--load-forge-rollout-data",
                       reason="replaying rollouts with live engines is not implemented; --load-debug-rollout-data "
                              "replays without engines"),
    NotImplementedFlag(flag="--ckpt-format", is_active=lambda v: v != "torch_dist",
                       reason="checkpoints are saved and loaded with dist_checkpointing (torch_dist) only"),
    NotImplementedFlag(flag="--fp16", reason="fp16 training (loss scaling) is not implemented; use --bf16 or fp32"),
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
        if is_on and (entry.applies is None or entry.applies(args)):
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
        fail("; ".join(messages))


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def resolve_train_device(args: argparse.Namespace) -> str:
    """'cpu' or 'cuda' from --train-backend-device (auto: cuda when torch sees a GPU)."""
    if args.train_backend_device != "auto":
        return args.train_backend_device
    import torch  # deferred: --help and pure parsing should not pay for torch

    return "cuda" if torch.cuda.is_available() else "cpu"
