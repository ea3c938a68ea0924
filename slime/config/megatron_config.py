"""``--megatron-config-path``: upstream's per-role Megatron overrides, read and checked before the pre-Ray checks.

The file is upstream's YAML: a top-level ``megatron`` list of entries ``{name, role, overrides}`` (``args`` is
accepted for ``overrides``), at most one per role, roles ``actor`` and ``critic``. A role without an entry runs
the command line's values. Keys are the flags' attribute names (``tensor_model_parallel_size``, ``lr``); dashed
names (``tensor-model-parallel-size``) name the same flag. Values are converted the way the flag's own type would
(YAML leaves ``1e-5`` a string).

What a role may set here is what its trainer ranks read and can hold apart from the other role: the parallel
layout, the optimizer and its schedule, batching, recomputation, and where its checkpoints live (``load``,
``save``). Any other key names a setting the two roles share (rollout, algorithm, model architecture) and is
refused, as is a key that names no flag (upstream sets such a key anyway; here it would do nothing).

How each role's overrides land:
  actor   onto the run's flags, so every pre-Ray check sees them (the engines' side reads none of these keys).
  critic  ``lr``, ``lr_warmup_iters``, ``load`` and ``save`` are --critic-lr, --critic-lr-warmup-iters,
          --critic-load and --critic-save; the rest, with the command line's value of each key only the actor's
          entry changed (upstream: a role inherits the command line, not the other role), are the critic's own
          flags, checked as a whole by checks/roles.py and kept in ``args.critic_overrides``.
``num_nodes`` / ``num_gpus_per_node`` must equal the role's command-line counts: GPU allocation follows the
command line, as upstream.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Mapping

from slime.algorithms import estimator
from slime.config.custom_config import coerce_config_value, config_key_dest
from slime.config.errors import fail, flag_name, require_path

ROLES = ("actor", "critic")

# The argument groups whose flags a role's trainer ranks read and can hold apart from the other role's.
ROLE_GROUPS = ("megatron parallel", "megatron optimizer/training")
ROLE_EXTRA_KEYS = frozenset({"use_dynamic_batch_size", "max_tokens_per_gpu", "log_probs_max_tokens_per_gpu",
                             "num_steps_per_rollout", "load", "save"})
# Flags of those groups both roles share: the training backend and the rollout weights' FP8 scale (engine side).
SHARED_KEYS = frozenset({"train_backend", "force_fp8_ue8m0_scale"})
# The critic's own command-line flags, which its entry's keys of the same meaning stand for.
CRITIC_FLAG_OF = {"lr": "critic_lr", "lr_warmup_iters": "critic_lr_warmup_iters", "load": "critic_load",
                  "save": "critic_save"}
GPU_COUNT_KEYS = ("num_nodes", "num_gpus_per_node")


@dataclass(frozen=True, kw_only=True)
class RoleConfig:
    """The overrides of each role read from --megatron-config-path: flag attribute names to converted values."""

    path: str
    """The YAML file they were read from (named in every error about them)."""
    actor: Mapping[str, Any] = field(default_factory=dict)
    """The actor's entry: applied to the run's flags."""
    critic: Mapping[str, Any] = field(default_factory=dict)
    """The critic's entry: its own flags (checks/roles.py)."""


def role_keys(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The flag attribute names a role's entry may set."""
    grouped = {action.dest for group in parser._action_groups if group.title in ROLE_GROUPS
               for action in group._group_actions}
    return frozenset(grouped - SHARED_KEYS) | ROLE_EXTRA_KEYS


def read_role_config(path: str, parser: argparse.ArgumentParser) -> RoleConfig:
    """Parse upstream's file into each role's checked, converted overrides; refuse what this project cannot
    honour, naming the key."""
    import yaml

    require_path("--megatron-config-path", path, "file")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    entries = raw.get("megatron") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        fail(f"--megatron-config-path {path}: expected a top-level 'megatron' list, e.g. "
             "megatron: [{name: default, role: critic, overrides: {lr: 1e-5, tensor_model_parallel_size: 2}}]")
    by_role: dict[str, Mapping[str, Any]] = {}
    for entry in entries:
        role = entry.get("role") if isinstance(entry, dict) else None
        if role not in ROLES:
            fail(f"--megatron-config-path {path}: entry {entry!r} needs role: actor or role: critic (the roles "
                 "this project trains)")
        if role in by_role:
            fail(f"--megatron-config-path {path}: more than one entry with role: {role}; merge them into one")
        overrides = entry.get("overrides") or entry.get("args") or {}
        if not isinstance(overrides, dict):
            fail(f"--megatron-config-path {path}: the {role} entry's overrides must be a mapping of flag names to "
                 f"values, got {type(overrides).__name__}")
        by_role[role] = _converted(path, role, overrides, parser)
    return RoleConfig(path=path, **by_role)


def _converted(path: str, role: str, overrides: Mapping[str, Any], parser: argparse.ArgumentParser
               ) -> dict[str, Any]:
    allowed = role_keys(parser)
    out = {}
    for key, value in overrides.items():
        if key in GPU_COUNT_KEYS:
            out[key] = value
            continue
        dest = config_key_dest(str(key), parser)
        if dest is None:
            fail(f"--megatron-config-path {path}: the {role} entry's key {key!r} is not a flag of train.py; "
                 "fix its name (the flag's attribute name, e.g. tensor_model_parallel_size)")
        if dest not in allowed:
            fail(f"--megatron-config-path {path}: the {role} entry's key {key!r} ({flag_name(dest)}) is not a "
                 "per-role setting here: both roles share it (the rollout, the algorithm, the model's "
                 "architecture); pass it on the command line")
        out[dest] = _checked_value(path, role, key, parser, dest, value)
    return out


def _checked_value(path: str, role: str, key: str, parser: argparse.ArgumentParser, dest: str, value: Any) -> Any:
    action = next(a for a in parser._actions if a.dest == dest)
    if action.nargs == 0 and not isinstance(value, bool):  # store_true/false: a switch
        fail(f"--megatron-config-path {path}: the {role} entry's {key} is a switch; give it true or false, "
             f"not {value!r}")
    try:
        value = coerce_config_value(action, value)
    except (TypeError, ValueError) as exc:
        fail(f"--megatron-config-path {path}: the {role} entry's {key} {value!r}: {exc}")
    if action.choices is not None and value not in action.choices:
        fail(f"--megatron-config-path {path}: the {role} entry's {key} {value!r} is not one of "
             f"{sorted(action.choices)}")
    return value


def check_gpu_counts(args: argparse.Namespace, config: RoleConfig) -> None:
    """num_nodes / num_gpus_per_node may only repeat the role's command-line counts."""
    for role, overrides in (("actor", config.actor), ("critic", config.critic)):
        for key in GPU_COUNT_KEYS:
            if key not in overrides:
                continue
            dest = f"{role}_{key}"
            cli = getattr(args, dest)
            if cli is None:  # the critic's counts default to the actor's
                cli = getattr(args, f"actor_{key}")
            if overrides[key] != cli:
                fail(f"--megatron-config-path {config.path}: the {role} entry's {key} {overrides[key]} differs from "
                     f"{flag_name(dest)} {cli}: GPU counts follow the command line; set {flag_name(dest)} there")


def apply_role_config(args: argparse.Namespace, config: RoleConfig) -> dict[str, Any]:
    """The actor's entry onto the run's flags; the critic's checkpoint and rate keys onto its own flags. Returns
    the critic's other overrides (its layout, optimizer, batching), inheriting the command line's value of every
    key only the actor's entry changed."""
    check_gpu_counts(args, config)
    actor = {k: v for k, v in config.actor.items() if k not in GPU_COUNT_KEYS}
    critic = {k: v for k, v in config.critic.items() if k not in GPU_COUNT_KEYS}
    command_line = {key: getattr(args, key) for key in actor}
    for key, value in actor.items():
        setattr(args, key, value)
    for key, flag in CRITIC_FLAG_OF.items():
        if key in critic:
            if getattr(args, flag) is not None:
                fail(f"--megatron-config-path {config.path}: the critic entry's {key} and {flag_name(flag)} both "
                     "set the critic's; keep one")
            setattr(args, flag, critic.pop(key))
        elif (key in actor and key in ("lr", "lr_warmup_iters") and getattr(args, flag) is None
              and estimator(args.advantage_estimator).needs_critic):
            setattr(args, flag, command_line[key])  # the critic keeps the command line's, not the actor's
    inherited = {k: v for k, v in command_line.items() if k not in critic and k not in CRITIC_FLAG_OF}
    return {**inherited, **critic}
