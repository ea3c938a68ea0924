"""Checks and derived values of batching: global and micro-batch sizes, the DP split and CP padding."""

from __future__ import annotations

import argparse
import logging
import warnings

from slime.config.errors import derive, fail, named
from slime.utils.misc import round_up

logger = logging.getLogger(__name__)


def check_batching(args: argparse.Namespace) -> None:
    if args.use_dynamic_batch_size:
        if args.max_tokens_per_gpu is None:
            fail("--use-dynamic-batch-size needs --max-tokens-per-gpu (the per-rank token budget of a micro-batch)")
        if args.log_probs_max_tokens_per_gpu is None:
            derive(args, "log_probs_max_tokens_per_gpu", args.max_tokens_per_gpu,
                   f"--max-tokens-per-gpu {args.max_tokens_per_gpu}")
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    rollout = f"--rollout-batch-size {args.rollout_batch_size} x --n-samples-per-prompt {args.n_samples_per_prompt}"
    if args.num_steps_per_rollout is not None:
        steps = args.num_steps_per_rollout
        if steps <= 0 or samples % steps:
            fail(f"--num-steps-per-rollout {steps} must be positive and divide the rollout's {samples} samples "
                 f"({rollout})")
        if args.global_batch_size is not None and args.global_batch_size != samples // steps:
            fail(f"--global-batch-size {args.global_batch_size} contradicts --num-steps-per-rollout {steps} "
                 f"({rollout} // {steps} = {samples // steps}); pass only one of them")
        derive(args, "global_batch_size", samples // steps, f"{rollout} // --num-steps-per-rollout {steps}")
    elif args.global_batch_size is None:
        logger.info("--global-batch-size not set: one optimizer step per rollout (%d samples)", samples)
        derive(args, "global_batch_size", samples, f"one step per rollout = {rollout}")
    gbs = args.global_batch_size
    if gbs <= 0 or samples % gbs:
        fail(f"the rollout's {samples} samples ({rollout}) are not a multiple of {named(args, 'global_batch_size')}")
    args.num_steps_per_rollout = samples // gbs


def check_batch_split(args: argparse.Namespace) -> None:
    """Every DP rank must get the same number of samples (and static micro-batches) per step."""
    gbs, dp = args.global_batch_size, args.data_parallel_size
    dp_text = f"data-parallel size {dp} (= {args.derived_values['data_parallel_size']})"
    if gbs % dp:
        fail(f"{named(args, 'global_batch_size')} is not divisible by the {dp_text}")
    if not args.use_dynamic_batch_size and gbs % (args.micro_batch_size * dp):
        fail(f"{named(args, 'global_batch_size')} is not divisible by --micro-batch-size {args.micro_batch_size} "
             f"x {dp_text}; fix the sizes or use --use-dynamic-batch-size")


def check_context_parallel(args: argparse.Namespace) -> None:
    """Zig-zag CP pads each sequence to a multiple of 2*CP and gives every CP rank two chunks of it."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    pad = 2 * cp
    if args.seq_length is not None and args.seq_length % pad:
        fail(f"--seq-length {args.seq_length} is not a multiple of 2*CP = {pad}; CP slicing needs it "
             f"(use {round_up(args.seq_length, pad)})")
    if args.max_tokens_per_gpu is not None and args.max_tokens_per_gpu < 2:
        fail(f"--max-tokens-per-gpu {args.max_tokens_per_gpu} cannot hold the two CP chunks every rank gets; use >= 2")
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
