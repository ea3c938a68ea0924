"""The order of the pre-Ray checks: derived values first, then cross-flag checks."""

from __future__ import annotations

import argparse

from slime.algorithms import estimator
from slime.config.checks.algorithm import check_algorithm, check_opd, check_plugins
from slime.config.checks.critic import check_critic
from slime.config.checks.roles import before_checks, check_critic_role, refuse_critic_entry_without_critic
from slime.config.checks.checkpoints import check_load, resolve_checkpoint_retention
from slime.config.checks.lora import check_lora_flags
from slime.config.checks.batching import check_batch_split, check_batching, check_context_parallel
from slime.config.checks.multimodal import check_multimodal
from slime.config.checks.model import check_model_shape, check_mtp, check_recompute, resolve_model_defaults
from slime.config.checks.optimizer import resolve_optimizer_offload
from slime.config.checks.paths import check_paths, check_spec
from slime.config.checks.rollout import (
    check_logprob_mismatch,
    check_rollout_faults,
    check_weight_sync,
    resolve_eval_datasets,
    resolve_rollout_defaults,
)
from slime.config.checks.run import (check_deadlines, check_healing, check_ledger, check_positive,
                                     check_weight_sync_proof, resolve_modes, resolve_tracking)
from slime.config.layout import check_parallel_layout
from slime.config.megatron_config import apply_role_config, read_role_config
from slime.config.parser import build_parser
from slime.config.registries import refuse_unsupported


def validate_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None,
                  device: str = "cpu") -> argparse.Namespace:
    """Fill derived values and check flag combinations in place; raises ArgumentValidationError with the fix."""
    parser = parser or build_parser()
    args.derived_values = {}
    roles = read_role_config(args.megatron_config_path, parser) if args.megatron_config_path else None
    critic_overrides = apply_role_config(args, roles) if roles else {}
    before = before_checks(args)
    refuse_unsupported(args, parser, device)
    check_positive(args)
    check_recompute(args)
    check_deadlines(args)
    check_healing(args)
    check_weight_sync_proof(args)
    resolve_optimizer_offload(args)
    resolve_model_defaults(args)
    resolve_modes(args)
    resolve_rollout_defaults(args)
    if not args.debug_rollout_only:
        check_model_shape(args)
        check_mtp(args)
        check_parallel_layout(args)
        check_batching(args)
        check_batch_split(args)
        check_context_parallel(args)
    check_algorithm(args)
    if roles:
        refuse_critic_entry_without_critic(args, roles.critic, roles.path)
    check_load(args)
    resolve_checkpoint_retention(args)
    check_critic(args)
    if estimator(args.advantage_estimator).needs_critic and not args.debug_rollout_only:
        check_critic_role(args, critic_overrides, before, parser, device, roles.path if roles else "")
    check_logprob_mismatch(args)
    check_weight_sync(args)
    check_plugins(args)
    check_lora_flags(args)
    check_opd(args)
    check_spec(args)
    check_ledger(args)
    check_rollout_faults(args, parser)
    resolve_tracking(args)
    resolve_eval_datasets(args)
    check_paths(args, parser)
    check_multimodal(args)
    return args
