"""The run's facts after parsing (slime/config/run_state.py) and the sub-configs readers take from the RunConfig."""
from __future__ import annotations

import dataclasses

import pytest

from arg_testing import parse_error, parse_quiet
from slime.config import defaults_namespace
from slime.config.run_config import run_config_of, run_layout
from slime.config.run_state import PUBLISHED, advance, run_state_of

MINIMAL = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "2",
           "--train-backend-device", "cpu", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"]


def test_a_fact_is_replaced_never_mutated_and_only_upstreams_names_are_published():
    args = defaults_namespace(start_rollout_id=3)
    before = run_state_of(args)
    assert (before.start_rollout_id, before.start_rollout_id_given, before.restart_count) == (3, True, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.spans_nodes = True
    flags = dict(vars(args))
    after = advance(args, spans_nodes=True, router_ip="10.0.0.2", router_port=4000, num_rollout=9)
    assert not before.spans_nodes and after.spans_nodes and run_state_of(args) is after
    changed = {name for name, value in vars(args).items() if flags.get(name, object()) != value}
    # the state itself, and the names upstream's plug-ins read (rollout functions reach the router by them)
    assert changed == {"run_state", "sglang_router_ip", "sglang_router_port", "num_rollout"}
    assert set(PUBLISHED.values()) >= changed - {"run_state"}
    assert (args.sglang_router_ip, args.sglang_router_port, args.num_rollout) == ("10.0.0.2", 4000, 9)


def test_the_engine_count_and_the_rollout_sizes_are_the_run_configs(monkeypatch):
    from slime.rollout.sglang_rollout import concurrency

    args = parse_quiet([*MINIMAL, "--over-sampling-batch-size", "64", "--rollout-batch-size", "32",
                        "--n-samples-per-prompt", "4", "--sglang-server-concurrency", "16"])
    run = args.run_config
    assert run.roles.engines == 2 and run_config_of(args) is run
    assert (run.rollout.samples, run.rollout.samples_drawn, run.rollout.concurrency_per_engine) == (128, 256, 16)
    assert concurrency(args) == 2 * 16  # the rollout's in-flight cap: per engine x the run's engines
    hand_built = defaults_namespace(rollout_num_gpus=6, rollout_num_gpus_per_engine=3)
    assert run_config_of(hand_built).roles.engines == 2  # arguments without a command line: the same rule


def test_a_rank_in_another_world_than_the_run_layouts_is_refused():
    args = parse_quiet(MINIMAL)
    assert run_layout(args, 2) is args.run_config.layout
    with pytest.raises(ValueError, match="for 2 ranks, but this rank's torch.distributed world has 4"):
        run_layout(args, 4)
    assert run_layout(defaults_namespace(), 4).world_size == 4  # hand-built: the layout of its flags over that world


def test_full_recomputation_needs_its_method_and_layer_count_before_ray_starts(capsys):
    said = parse_error([*MINIMAL, "--recompute-granularity", "full"], capsys)
    assert "--recompute-granularity full needs --recompute-method" in said
    args = parse_quiet([*MINIMAL, "--recompute-granularity", "full", "--recompute-method", "uniform",
                        "--recompute-num-layers", "2"])
    assert args.recompute_num_layers == 2


def test_tensorboard_dir_is_completed_by_the_config_for_hand_built_args_too():
    assert defaults_namespace(use_tensorboard=True).tensorboard_dir == "tensorboard_log"
    assert defaults_namespace(tb_project_name="p").tensorboard_dir == "p"
    assert defaults_namespace().tensorboard_dir is None  # TensorBoard off
    assert parse_quiet([*MINIMAL, "--use-tensorboard"]).tensorboard_dir == "tensorboard_log"
