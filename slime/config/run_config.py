"""The run's derived configuration, typed and frozen: built once by ``parse_args`` from the checked flags and
attached as ``args.run_config``, so that the rooms that need the parallel layout, the deadline model, who runs
(trainer, critic, engines; colocated or apart), the size of a rollout, the loss, the process groups, the engines'
health checks, the restart policy or the weight deltas read one value instead of each recomputing it from raw
flags. Each component takes its sub-config as an argument; ``build_run_config`` is the one place that derives
them (the critic's own run config too: critic_role.critic_args). The flags themselves stay on ``args``; nothing
here changes after parsing.

Code that runs without a command line (tests, tools) gets it from its namespace with ``run_config_of`` (or one
sub-config with ``run_loss`` and its kin), derived from its flags by the same builders. What the run learns after
parsing (placement, hosts, the router, the resume position, restarts) is the RunState (run_state.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime.algorithms import estimator
from slime.config.health import HealingPolicy, HealthConfig, build_healing_policy, build_health_config
from slime.config.layout import ParallelLayout, build_parallel_layout, critic_has_own_bundles, critic_world_size
from slime.config.loss import LossConfig, ValueLossConfig, build_loss_config, build_value_loss_config
from slime.config.process_groups import GroupSettings, build_group_settings
from slime.config.weight_sync import DeltaOptions, build_delta_options
from slime.utils.deadlines import DeadlineModel


@dataclass(frozen=True, kw_only=True)
class RunRoles:
    """Who runs, and whether the trainer and the engines share GPUs."""

    trainer_ranks: int
    """The actor's training ranks (0 with --debug-rollout-only)."""
    critic_ranks: int
    """The critic's training ranks with --advantage-estimator ppo (0 without a critic or with --debug-rollout-only)."""
    critic_own_bundles: bool
    """The critic on GPUs of its own (--critic-num-* other than the actor's), else on the trainer ranks' GPUs."""
    engines: int
    """Rollout engines: --rollout-num-gpus / --rollout-num-gpus-per-engine (0 with --debug-train-only)."""
    gpus_per_engine: int
    """GPUs of each engine (--rollout-num-gpus-per-engine)."""
    colocate: bool
    """Trainer and engines take turns on the same GPUs (--colocate)."""


@dataclass(frozen=True, kw_only=True)
class RolloutSize:
    """The size of one rollout."""

    prompts: int
    """Prompts per rollout (--rollout-batch-size)."""
    samples_per_prompt: int
    """Samples generated per prompt (--n-samples-per-prompt)."""
    prompts_per_draw: int
    """Prompts drawn per sampling round (--over-sampling-batch-size, else --rollout-batch-size)."""
    eval_samples_per_prompt: int
    """Samples per evaluation prompt (--n-samples-per-eval-prompt; an eval dataset may set its own)."""
    concurrency_per_engine: int
    """Requests in flight per engine (--sglang-server-concurrency)."""

    @property
    def samples(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def samples_drawn(self) -> int:
        """Samples of one sampling round: the most one rollout generates at once."""
        return self.prompts_per_draw * self.samples_per_prompt


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What the run derives from its flags once: read as ``args.run_config``."""

    layout: ParallelLayout
    """The training ranks' parallel layout (of this role's world: the critic's own with ``critic_args``)."""
    deadlines: DeadlineModel
    """The progress windows of the ranks and of the driver's wait on them (slime/utils/deadlines.py)."""
    roles: RunRoles
    rollout: RolloutSize
    loss: LossConfig
    """The policy loss (slime/backends/megatron_utils/loss.py)."""
    value_loss: ValueLossConfig
    """The critic's value loss (value_loss.py; read from the critic's own run config)."""
    groups: GroupSettings
    """The training ranks' process groups over ``layout`` (slime/distributed/groups.py)."""
    health: HealthConfig
    """How the rollout manager watches its engines (slime/ray/engines/health.py)."""
    healing: HealingPolicy
    """How many named failures the driver heals by a restart (slime/ray/driver/healing.py)."""
    delta: DeltaOptions | None
    """The weight push's delta encoding (--update-weight-mode delta), None for full pushes."""


def build_run_config(args: Any, *, world_size: int | None = None) -> RunConfig:
    """The run config of checked flags (``world_size``: of this role's ranks; default, the actor's)."""
    rollout_only, train_only = args.debug_rollout_only, args.debug_train_only
    engine_gpus = 0 if train_only or args.rollout_num_gpus is None else args.rollout_num_gpus
    use_critic = estimator(args.advantage_estimator).needs_critic  # as the checks derive --use-critic
    roles = RunRoles(
        trainer_ranks=0 if rollout_only else args.actor_num_nodes * args.actor_num_gpus_per_node,
        critic_ranks=critic_world_size(args) if use_critic and not rollout_only else 0,
        critic_own_bundles=critic_has_own_bundles(args),
        engines=engine_gpus // args.rollout_num_gpus_per_engine,
        gpus_per_engine=args.rollout_num_gpus_per_engine,
        colocate=bool(args.colocate),
    )
    layout, deadlines = build_parallel_layout(args, world_size=world_size), DeadlineModel.from_args(args)
    return RunConfig(layout=layout, deadlines=deadlines, roles=roles, rollout=rollout_size(args),
                     loss=build_loss_config(args), value_loss=build_value_loss_config(args),
                     groups=build_group_settings(args, layout, deadlines),
                     health=build_health_config(args, deadlines), healing=build_healing_policy(args),
                     delta=build_delta_options(args))


def rollout_size(args: Any) -> RolloutSize:
    drawn = args.rollout_batch_size if args.over_sampling_batch_size is None else args.over_sampling_batch_size
    return RolloutSize(prompts=args.rollout_batch_size, samples_per_prompt=args.n_samples_per_prompt,
                       prompts_per_draw=drawn, eval_samples_per_prompt=args.n_samples_per_eval_prompt,
                       concurrency_per_engine=args.sglang_server_concurrency)


def run_groups(args: Any, world_size: int) -> GroupSettings:
    """The process groups a running world of `world_size` ranks trains in: the run config's (checked against the
    world it runs in: a rank started in another world would build other groups than its peers); arguments built
    without a command line get the groups of their flags over that world."""
    run_config = vars(args).get("run_config")
    if run_config is None:
        deadlines = DeadlineModel.from_args(args)
        return build_group_settings(args, build_parallel_layout(args, world_size=world_size), deadlines)
    check_world(run_config.groups, world_size)
    return run_config.groups


def check_world(groups: GroupSettings, world_size: int) -> None:
    """Refuse groups laid out for another world than the one this rank runs in."""
    if groups.parallel.world_size != world_size:
        raise ValueError(f"the run's parallel layout is for {groups.parallel.world_size} ranks, but this rank's "
                         f"torch.distributed world has {world_size}")


def run_layout(args: Any, world_size: int) -> ParallelLayout:
    """The parallel layout of ``run_groups``."""
    return run_groups(args, world_size).parallel


def run_config_of(args: Any) -> RunConfig:
    """The run config parse_args built (``args.run_config``); arguments built without a command line
    (slime/config/defaults.py) get theirs from their flags by the same rule."""
    run_config = vars(args).get("run_config")
    return run_config if run_config is not None else build_run_config(args)


def run_loss(args: Any) -> LossConfig:
    """The run config's policy loss (arguments without a command line: of their flags)."""
    return _part(args, "loss", build_loss_config)


def run_value_loss(args: Any) -> ValueLossConfig:
    """The run config's value loss (the critic's namespace: its own; without a command line: of the flags)."""
    return _part(args, "value_loss", build_value_loss_config)


def run_health(args: Any) -> HealthConfig:
    """The run config's engine health checks (arguments without a command line: of their flags)."""
    return _part(args, "health", lambda flags: build_health_config(flags, DeadlineModel.from_args(flags)))


def run_delta(args: Any) -> DeltaOptions | None:
    """The run config's delta options (arguments without a command line: of their flags)."""
    return _part(args, "delta", build_delta_options)


def _part(args: Any, name: str, build: Any) -> Any:
    """One sub-config of the run config parse_args built, or, without one, built from the flags by its builder."""
    run_config = vars(args).get("run_config")
    return getattr(run_config, name) if run_config is not None else build(args)
