"""The --max-restarts policy (slime/ray/driver/healing.py) without Ray: when a named failure restarts the run,
from which checkpoint, and when it stops instead (the healed train.py runs are in tests/test_exact_resume.py)."""
from __future__ import annotations

import argparse

import pytest

from slime.ray.driver.healing import (Failure, HealingPolicy, HealingRefusedError, RepeatedFailureError, Restart,
                                      plan_restart, train_with_healing)
from slime.ray.driver.rank_wait import RankFailedError
from slime.ray.rollout_manager.errors import EngineFailedError


def failure(rollout_id: int, ranks=(), nodes=()) -> Failure:
    return Failure(cause=f"failed in rollout {rollout_id}", error="RankFailedError", rollout_id=rollout_id,
                   ranks=tuple(ranks), nodes=tuple(nodes))


def test_a_restart_goes_back_to_the_last_checkpoint_and_counts():
    policy = HealingPolicy(max_restarts=2)
    first = plan_restart(policy, (), failure(5, ranks=[1]), 3, multi_node=False)
    assert (first.number, first.checkpoint) == (1, 3)
    second = plan_restart(policy, (first,), failure(7, ranks=[0]), 6, multi_node=False)
    assert (second.number, second.checkpoint) == (2, 6)
    assert plan_restart(policy, (first, second), failure(8, ranks=[1]), 7, multi_node=False) is None  # spent


def test_the_same_rank_twice_in_a_row_stops_the_run():
    policy = HealingPolicy(max_restarts=5)
    first = plan_restart(policy, (), failure(2, ranks=[1]), 1, multi_node=False)
    with pytest.raises(RepeatedFailureError, match=r"rank\(s\) \[1\] failed again"):
        plan_restart(policy, (first,), failure(3, ranks=[0, 1]), 2, multi_node=False)


def test_the_same_node_twice_stops_a_multi_node_run_only():
    policy = HealingPolicy(max_restarts=5)
    first = plan_restart(policy, (), failure(2, ranks=[0], nodes=["10.0.0.1"]), 1, multi_node=True)
    with pytest.raises(RepeatedFailureError, match=r"node\(s\) \['10.0.0.1'\]"):
        plan_restart(policy, (first,), failure(3, ranks=[1], nodes=["10.0.0.1"]), 2, multi_node=True)
    # one node: every failure is on it, so only a repeated rank stops the run
    assert plan_restart(policy, (first,), failure(3, ranks=[1], nodes=["10.0.0.1"]), 2, multi_node=False) is not None


def test_no_checkpoint_or_one_outside_the_window_is_a_named_refusal():
    with pytest.raises(HealingRefusedError, match="no complete checkpoint"):
        plan_restart(HealingPolicy(max_restarts=1), (), failure(0, ranks=[0]), None, multi_node=False)
    window = HealingPolicy(max_restarts=1, window_rollouts=2)
    with pytest.raises(HealingRefusedError,
                       match="3 rollouts before the failed rollout 7.*--restart-window-rollouts 2"):
        plan_restart(window, (), failure(7), 3, multi_node=False)
    assert plan_restart(window, (), failure(7), 4, multi_node=False).checkpoint == 4  # 2 rollouts lost: within


def run_args(tmp_path, max_restarts: int) -> argparse.Namespace:
    return argparse.Namespace(max_restarts=max_restarts, restart_window_rollouts=None, save=str(tmp_path),
                              ledger_dir=None, load=None, finetune=True, start_rollout_id=0,
                              start_rollout_id_given=True, restart_count=0)


def publish(tmp_path, iteration: int) -> None:
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def test_the_loop_resumes_from_save_and_stops_on_an_unnamed_error(tmp_path):
    args = run_args(tmp_path, max_restarts=3)
    seen = []

    def train(a):
        seen.append((a.load, a.start_rollout_id, a.finetune, a.restart_count))
        if len(seen) == 1:
            publish(tmp_path, 1)
            error = RankFailedError("phase 'actor_train': rank 1 exited", phase="actor_train", ranks=(1,))
            error.failed_rollout_id = 2
            raise error
        if len(seen) == 2:
            publish(tmp_path, 2)
            raise EngineFailedError("engine 0 died")  # no rank: never a repeat
        raise ValueError("a bug, not a named failure")

    with pytest.raises(ValueError, match="a bug"):
        train_with_healing(train, args)
    assert seen == [(None, 0, True, 0), (str(tmp_path), None, False, 1), (str(tmp_path), None, False, 2)]
    assert args.restart_checkpoint == 2


def test_without_max_restarts_a_named_failure_ends_the_run(tmp_path):
    publish(tmp_path, 0)
    calls = []

    def train(a):
        calls.append(a)
        raise TimeoutError("rollout 1 timed out")

    with pytest.raises(TimeoutError):
        train_with_healing(train, run_args(tmp_path, max_restarts=0))
    assert len(calls) == 1


@pytest.mark.parametrize("extra, message", [
    ([], "add --save DIR and --save-interval N"),
    (["--save", "/tmp/x"], "add --save DIR and --save-interval N"),
    (["--save", "/tmp/x", "--save-interval", "1", "--restart-window-rollouts", "-1"], "must be >= 0"),
])
def test_max_restarts_without_saves_is_refused_before_ray(extra, message, capsys):
    from slime.config.parse import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
                    "--train-backend-device", "cpu", "--max-restarts", "2", *extra])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_restarts_are_typed_records():
    restart = Restart(number=1, failure=failure(1), checkpoint=0)
    with pytest.raises(AttributeError):
        restart.number = 2  # frozen


def test_the_failed_attempt_s_ledger_files_move_aside(tmp_path):
    from slime.ray.driver.healing import archive_ledger

    for name in ("rank0.json", "stacks_rank1.txt", "fault_fired_kill_rank_during_train_0_1"):
        (tmp_path / name).write_text(name)
    archive_ledger(str(tmp_path), 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt1", "fault_fired_kill_rank_during_train_0_1"]
    assert (tmp_path / "attempt1" / "stacks_rank1.txt").read_text() == "stacks_rank1.txt"


def test_a_failure_blames_the_lagging_rank_and_its_node():
    from slime.ray.driver.healing import failure_of, note_failure

    error = RankFailedError("phase 'actor_train' failed on rank 0: FenceTimeoutError: ...", phase="actor_train",
                            ranks=(0,), blamed=(1,))
    note_failure(error, 3, ["10.0.0.1", "10.0.0.2"])
    failure = failure_of(error, 0)
    assert (failure.ranks, failure.nodes, failure.rollout_id) == ((1,), ("10.0.0.2",), 3)
