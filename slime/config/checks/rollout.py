"""Checks and derived values of the rollout: its defaults, reward type, deadlines and fault tolerance,
engine backend, log-prob agreement with the trainer, weight sync and the eval datasets.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import warnings

from slime.config.engine import RETURN_ORIGINAL_LOGPROB_ENV, pick_rollout_backend, return_original_logprob
from slime.config.errors import ArgumentValidationError, derive, fail, require_path
from slime.rollout.eval_config import EvalDatasetSpec, load_eval_config
from slime.utils.checksums import missing_package

logger = logging.getLogger(__name__)


def resolve_rollout_defaults(args: argparse.Namespace) -> None:
    if args.num_rollout is None and args.num_epoch is None:
        fail("set --num-rollout N (rollout steps) or --num-epoch N")
    for flag, count in (("--num-rollout", args.num_rollout), ("--num-epoch", args.num_epoch)):
        if count is not None and count <= 0:
            fail(f"{flag} {count} runs no rollout: the run would start Ray, the engines and the trainer ranks, then "
                 "stop without training; pass a positive count (upstream's eval-only run, --num-rollout 0 with "
                 "--eval-interval, is not implemented here)")
    if args.over_sampling_batch_size is not None and args.over_sampling_batch_size < args.rollout_batch_size:
        fail(f"--over-sampling-batch-size {args.over_sampling_batch_size} must be >= --rollout-batch-size "
             f"{args.rollout_batch_size}")
    if args.mask_offpolicy_in_partial_rollout and not args.partial_rollout:
        fail("--mask-offpolicy-in-partial-rollout only acts on resumed samples: add --partial-rollout")
    if args.eval_function_path is None:
        derive(args, "eval_function_path", args.rollout_function_path, "--rollout-function-path")
    if args.eval_reward_key is None:
        args.eval_reward_key = args.reward_key
    check_rm_type(args)
    if args.n_samples_per_prompt == 1:
        args.grpo_std_normalization = False  # a group of one has no spread to divide by
    if args.rollout_max_context_len is not None:
        if args.rollout_max_prompt_len is None:
            args.rollout_max_prompt_len = args.rollout_max_context_len - 1
        if args.rollout_max_prompt_len > args.rollout_max_context_len - 1:
            fail(f"--rollout-max-prompt-len {args.rollout_max_prompt_len} leaves no room to generate within "
                 f"--rollout-max-context-len {args.rollout_max_context_len}")


def check_rm_type(args: argparse.Namespace) -> None:
    if args.rm_type is None or args.custom_rm_path is not None:
        return
    from slime.rollout.rm_hub import RM_TYPES

    base = args.rm_type[len("boxed_"):] if args.rm_type.startswith("boxed_") else args.rm_type
    if base not in RM_TYPES:
        close = difflib.get_close_matches(base, RM_TYPES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        fail(f"--rm-type {args.rm_type} is not a built-in reward{hint}; choose one of {', '.join(RM_TYPES)} "
             "(optionally boxed_<type>) or pass --custom-rm-path")


def check_rollout_faults(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.rollout_timeout is not None and args.rollout_timeout <= 0:
        fail(f"--rollout-timeout must be positive, got {args.rollout_timeout}")
    for dest in ("rollout_health_check_interval", "rollout_health_check_timeout", "rollout_no_progress_timeout"):
        if getattr(args, dest) <= 0:
            fail(f"--{dest.replace('_', '-')} must be positive, got {getattr(args, dest)}")
    if args.rollout_health_check_first_wait < 0:
        fail(f"--rollout-health-check-first-wait must be >= 0, got {args.rollout_health_check_first_wait}")
    health = ("rollout_health_check_interval", "rollout_health_check_timeout", "rollout_health_check_first_wait")
    changed = [f"--{d.replace('_', '-')}" for d in health if getattr(args, d) != parser.get_default(d)]
    if changed and not args.use_fault_tolerance:
        warnings.warn(f"{', '.join(changed)} only take effect with --use-fault-tolerance", stacklevel=4)


def check_rollout_backend(args: argparse.Namespace) -> None:
    """Resolve --rollout-backend once at parse time, so a choice that cannot work fails before start-up."""
    if args.debug_train_only:  # no engines
        return
    try:
        pick_rollout_backend(args)
    except ValueError as exc:
        raise ArgumentValidationError(str(exc)) from None


def check_logprob_mismatch(args: argparse.Namespace) -> None:
    """Engine vs trainer log-probs: both must mean the same distribution."""
    if args.use_rollout_logprobs and args.use_tis:
        fail("--use-rollout-logprobs and --use-tis cannot be combined: TIS corrects the trainer's old policy "
             "towards the engines', which --use-rollout-logprobs already uses; drop one")
    if return_original_logprob() and args.rollout_temperature != 1.0:
        # The engines then report temperature-1 log-probs while the trainer's are at the rollout temperature.
        message = (f"{RETURN_ORIGINAL_LOGPROB_ENV} is set: engines return log-probs before the rollout temperature "
                   f"({args.rollout_temperature:g}), the trainer's are after it")
        if args.use_rollout_logprobs or args.use_tis:
            fail(f"{message}; --use-rollout-logprobs / --use-tis would mix the two distributions. "
                 f"Unset {RETURN_ORIGINAL_LOGPROB_ENV} or use --rollout-temperature 1")
        warnings.warn(f"{message}: train/train_rollout_logprob_abs_diff compares different distributions",
                      stacklevel=4)


def check_weight_sync(args: argparse.Namespace) -> None:
    if args.update_weight_mode not in ("full", "delta"):
        fail(f"--update-weight-mode {args.update_weight_mode} is not implemented; use full or delta")
    if args.update_weight_transport != "nccl":
        fail(f"--update-weight-transport {args.update_weight_transport} is not implemented; drop it (engines "
             "get tensors when colocated and a broadcast group otherwise)")
    if args.update_weight_mode == "delta":
        check_delta_sync(args)


def check_delta_sync(args: argparse.Namespace) -> None:
    """Deltas go to separate engines that apply them (the embedded engine), checked by an installed digest."""
    if args.colocate:
        fail("--update-weight-mode delta is for separate engines; colocated engines take the tensors on their own "
             "GPUs: drop --update-weight-mode delta or --colocate")
    if pick_rollout_backend(args) != "embedded":
        fail("--update-weight-mode delta needs engines that apply deltas (--rollout-backend embedded); SGLang "
             "engines take full pushes: drop --update-weight-mode delta")
    missing = missing_package(args.update_weight_delta_checksum)
    if missing:
        fail(f"--update-weight-delta-checksum {args.update_weight_delta_checksum} is not supported here without "
             f"the {missing} package: pip install {missing}, or pass --update-weight-delta-checksum adler32")


def resolve_eval_datasets(args: argparse.Namespace) -> None:
    if args.eval_config is not None:  # upstream: the config replaces --eval-prompt-data
        require_path("--eval-config", args.eval_config, "file")
        try:
            args.eval_datasets = load_eval_config(args.eval_config)
        except ValueError as exc:
            fail(str(exc))
        args.eval_prompt_data = [item for spec in args.eval_datasets for item in (spec.name, spec.path)]
        return
    values = list(args.eval_prompt_data or [])
    if len(values) == 1:
        logger.info("--eval-prompt-data given one path; naming the dataset 'aime' as upstream does")
        values = ["aime", values[0]]
    if len(values) % 2:
        fail(f"--eval-prompt-data takes NAME PATH pairs; got {len(values)} values: {values}")
    args.eval_datasets = tuple(EvalDatasetSpec(values[i], values[i + 1]) for i in range(0, len(values), 2))
    args.eval_prompt_data = values or None
    if args.eval_interval is not None and not args.eval_datasets:
        fail("--eval-interval needs --eval-prompt-data NAME PATH [NAME PATH ...] (or --eval-config FILE)")
