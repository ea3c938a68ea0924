"""The sub-configs of the run config (loss, value loss, process groups, engine health, restarts, deltas): a flag
given on the command line reaches the sub-config parse_args builds, and the component reads that one, never a
default or a value derived again from the flags (slime/config/run_config.py)."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

from arg_testing import parse_quiet
from slime.config import defaults_namespace
from slime.config.critic_role import critic_args
from slime.config.run_config import run_delta, run_groups, run_health, run_loss, run_value_loss
from slime.config.run_state import PUBLISHED, RunState, actor_args, advance

MINIMAL = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "2",
           "--train-backend-device", "cpu", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"]


def _differs_from_the_defaults(part, values: dict) -> None:
    """Each field the test sets is what the command line said, and not what a default would have given."""
    default = dataclasses.asdict(part(defaults_namespace()))
    for name, value in values.items():
        assert default[name] != value, f"{name}: the test must pick a value other than the default"


def test_the_loss_flags_reach_the_loss_config_the_trainer_reads():
    args = parse_quiet([*MINIMAL, "--eps-clip", "0.3", "--eps-clip-high", "0.35", "--use-kl-loss", "--kl-loss-coef",
                        "0.05", "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.01", "--rollout-temperature",
                        "0.7", "--calculate-per-token-loss", "--use-tis", "--tis-clip", "3.0",
                        "--advantage-estimator", "gspo"])
    loss = args.run_config.loss
    given = {"eps_clip": 0.3, "eps_clip_high": 0.35, "use_kl_loss": True, "kl_loss_coef": 0.05,
             "kl_loss_type": "low_var_kl", "entropy_coef": 0.01, "temperature": 0.7, "calculate_per_token_loss": True,
             "use_tis": True, "tis_clip": 3.0, "ratio_mode": "sequence"}
    assert {name: getattr(loss, name) for name in given} == given
    _differs_from_the_defaults(run_loss, given)
    assert run_loss(args) is loss  # the trainer's objective (train_step.policy_objective) takes this one


def test_the_health_flags_reach_the_health_config_the_rollout_guard_reads():
    args = parse_quiet([*MINIMAL, "--use-fault-tolerance", "--rollout-health-check-interval", "7",
                        "--rollout-health-check-timeout", "3", "--rollout-health-check-first-wait", "11",
                        "--rollout-no-progress-timeout", "123"])
    health = args.run_config.health
    given = {"fault_tolerant": True, "interval_s": 7.0, "timeout_s": 3.0, "first_wait_s": 11.0}
    assert {name: getattr(health, name) for name in given} == given
    _differs_from_the_defaults(run_health, given)
    assert health.progress is args.run_config.deadlines and health.progress.engine_no_progress_s == 123.0
    assert run_health(args) is health  # the rollout manager's RolloutGuard takes this one


def test_the_group_flags_reach_the_groups_a_rank_creates_and_another_world_is_refused():
    args = parse_quiet([*MINIMAL, "--tensor-model-parallel-size", "2", "--recreate-process-groups-on-wake",
                        "--single-rank-group-max-ctas", "4", "--fence-timeout", "77"])
    groups = run_groups(args, 2)
    assert groups is args.run_config.groups and groups.parallel is args.run_config.layout
    assert (groups.parallel.tp, groups.recreate_process_groups_on_wake, groups.single_rank_group_max_ctas,
            groups.fence_timeout_s) == (2, True, 4, 77.0)
    assert groups.group_timeout_s == args.run_config.deadlines.group_timeout
    with pytest.raises(ValueError, match="for 2 ranks, but this rank's torch.distributed world has 4"):
        run_groups(args, 4)


def test_the_delta_and_restart_flags_reach_their_sub_configs(tmp_path):
    args = parse_quiet([*MINIMAL, "--rollout-backend", "embedded", "--update-weight-mode", "delta",
                        "--update-weight-delta-encoding", "overwrite", "--update-weight-delta-checksum", "adler32",
                        "--max-restarts", "2", "--restart-window-rollouts", "3", "--save", str(tmp_path),
                        "--save-interval", "1"])
    assert (run_delta(args).encoding, run_delta(args).checksum) == ("overwrite", "adler32")
    assert run_delta(parse_quiet(MINIMAL)) is None  # full pushes
    assert (args.run_config.healing.max_restarts, args.run_config.healing.window_rollouts) == (2, 3)


def test_the_critic_takes_its_value_loss_from_its_own_run_config_by_the_same_builder():
    args = parse_quiet([*MINIMAL, "--advantage-estimator", "ppo", "--value-clip", "0.4", "--use-kl-loss",
                        "--kl-loss-coef", "0.1", "--eps-clip", "0.25"])
    critic = critic_args(args)
    assert run_value_loss(critic) is critic.run_config.value_loss and critic.run_config.value_loss.value_clip == 0.4
    assert critic.run_config.value_loss.value_loss is not None  # PPO's clipped value loss
    # the critic's flags drop the actor's KL term; everything else of the loss is the run's
    assert not critic.run_config.loss.use_kl_loss and args.run_config.loss.use_kl_loss
    assert critic.run_config.loss.eps_clip == args.run_config.loss.eps_clip == 0.25


def test_a_ray_actor_gets_the_run_state_as_an_argument_and_args_without_it():
    from slime.ray.engines.actor import EngineRayActor
    from slime.ray.rollout_manager.manager import RolloutManager
    from slime.ray.trainer.rank_actor import TrainRayActor

    args = parse_quiet(MINIMAL)
    state = advance(args, router_ip="10.0.0.3", router_port=4100, spans_nodes=True)
    shipped = actor_args(args)
    assert "run_state" in vars(args) and "run_state" not in vars(shipped)
    assert {name: getattr(shipped, name) for name in PUBLISHED.values()} == \
        {name: getattr(state, field) for field, name in PUBLISHED.items()}  # the plug-ins' names travel
    assert shipped.run_config is args.run_config
    for actor in (TrainRayActor, RolloutManager, EngineRayActor):
        parameter = inspect.signature(actor.__init__).parameters["run_state"]
        assert parameter.default is inspect.Parameter.empty and parameter.annotation in (RunState, "RunState")


def test_the_args_an_actor_unpickles_import_no_loss_module_and_no_torch(tmp_path):
    """An engine actor receives the run config but computes no loss: its loss terms are imported at their first
    call, so unpickling the args costs no torch import (~1.6 CPU-s per engine process otherwise)."""
    import pickle
    import subprocess
    import sys

    args = parse_quiet([*MINIMAL, "--advantage-estimator", "ppo", "--critic-load", str(tmp_path)])
    (tmp_path / "args.pkl").write_bytes(pickle.dumps(actor_args(args)))
    loaded = subprocess.run([sys.executable, "-c", (
        "import pickle, sys; args = pickle.load(open(sys.argv[1], 'rb')); "
        "print(sorted(m for m in ('torch', 'slime.algorithms.policy_loss', 'slime.algorithms.ppo')"
        " if m in sys.modules))"
    ), str(tmp_path / "args.pkl")], capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr
    loss, value = args.run_config.loss.policy_loss, args.run_config.value_loss.value_loss
    from slime.algorithms.policy_loss import ppo_clip_loss
    from slime.algorithms.ppo import compute_value_loss
    assert loss.resolve() is ppo_clip_loss and value.resolve() is compute_value_loss  # the estimator's own terms
