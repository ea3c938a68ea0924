"""The critic's own flags (--megatron-config-path's critic entry, on the critic's ranks: --critic-num-nodes x
--critic-num-gpus-per-node), checked as a whole before Ray starts: the run's checked flags with the critic's
overrides, re-derived (its data-parallel size, batch split) and put through the trainer-side checks the actor's
flags passed."""
from __future__ import annotations

import argparse
import copy
import warnings
from typing import Any, Callable

from slime.algorithms import estimator
from slime.config.checks.batching import check_batch_split, check_batching, check_context_parallel
from slime.config.checks.model import check_model_shape, check_mtp
from slime.config.errors import ArgumentValidationError, derive, fail
from slime.config.layout import build_parallel_layout, critic_counts, critic_has_own_bundles, critic_world_size
from slime.config.registries import active_not_implemented_flags, refusal_messages

# What the checks below derive from the layout and batch flags: recomputed for the critic from the values the
# run's flags had before the checks (or the critic's own).
ROLE_DERIVED = ("data_parallel_size", "global_batch_size", "num_steps_per_rollout", "log_probs_max_tokens_per_gpu",
                "sequence_parallel", "actor_world_size", "world_size")


def check_role_layout(role: argparse.Namespace) -> None:
    """The layout on the critic's own ranks (checks the sizes tile them) and the sizes derived from it."""
    world = critic_world_size(role)
    layout = build_parallel_layout(role, world_size=world)
    role.actor_world_size = role.world_size = world  # the critic's trainer world, as its ranks see it
    derive(role, "data_parallel_size", layout.dp, f"critic world {world} / (--tensor-model-parallel-size "
           f"{layout.tp} x --context-parallel-size {layout.cp} x --pipeline-model-parallel-size {layout.pp})")
    if role.sequence_parallel and layout.tp == 1:
        warnings.warn("--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabling it",
                      stacklevel=2)
        role.sequence_parallel = False


ROLE_CHECKS: tuple[Callable[[argparse.Namespace], None], ...] = (
    check_model_shape, check_mtp, check_role_layout, check_batching, check_batch_split, check_context_parallel)


def before_checks(args: argparse.Namespace) -> dict[str, Any]:
    """The derived keys' values before any check filled them (taken at the start of validate_args)."""
    return {key: getattr(args, key, None) for key in ROLE_DERIVED}  # world sizes and DP: not set yet (None)


def check_critic_role(args: argparse.Namespace, overrides: dict[str, Any], before: dict[str, Any],
                      parser: argparse.ArgumentParser, device: str, path: str) -> None:
    """Check the critic's flags (the run's, with `overrides`) as a whole; keep what differs from the run's in
    args.critic_overrides, for critic_role.critic_args."""
    role = _role_namespace(args, overrides, before)
    nodes, per_node = critic_counts(args)
    where = (f"the critic ({critic_world_size(args)} ranks: --critic-num-nodes {nodes} x --critic-num-gpus-per-node "
             f"{per_node})")
    if overrides:
        where += (f", with the critic entry of --megatron-config-path {path} "
                  f"({', '.join(f'{k}={v}' for k, v in sorted(overrides.items()))})")
    _refuse_unhonoured(role, args, parser, device, where)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for check in ROLE_CHECKS:
                check(role)
        except ArgumentValidationError as exc:
            fail(f"{where}: {exc}")
    for warning in caught if overrides or critic_has_own_bundles(args) else ():  # else: the actor's, said once
        warnings.warn(f"{where}: {warning.message}", stacklevel=3)
    args.critic_overrides = {key: getattr(role, key) for key in (*overrides, *ROLE_DERIVED)
                             if getattr(role, key) != getattr(args, key)}


def _role_namespace(args: argparse.Namespace, overrides: dict[str, Any], before: dict[str, Any]
                    ) -> argparse.Namespace:
    role = copy.copy(args)
    role.derived_values = {k: v for k, v in args.derived_values.items() if k not in ROLE_DERIVED}
    for key, value in {**before, **overrides}.items():
        setattr(role, key, value)
    return role


def _refuse_unhonoured(role: argparse.Namespace, args: argparse.Namespace, parser: argparse.ArgumentParser,
                       device: str, where: str) -> None:
    """A refused flag's value, or one that would have no effect, set only for the critic: refused naming it."""
    messages = refusal_messages(role, parser, device)
    run_warned = {entry.flag for entry in active_not_implemented_flags(args, parser, device)}
    messages += [f"{entry.flag} is not implemented here ({entry.reason})"
                 for entry in active_not_implemented_flags(role, parser, device) if entry.flag not in run_warned]
    if messages:
        fail(f"{where}: {'; '.join(messages)}")


def refuse_critic_entry_without_critic(args: argparse.Namespace, critic_entry: dict[str, Any], path: str) -> None:
    if critic_entry and not estimator(args.advantage_estimator).needs_critic:
        keys = ", ".join(sorted(critic_entry))
        fail(f"--megatron-config-path {path}: the critic entry ({keys}) configures the critic, which only "
             f"--advantage-estimator ppo trains; drop the entry or pass --advantage-estimator ppo")

