"""The --max-restarts policy (slime/ray/driver/healing.py) without Ray: when a named failure restarts the run,
from which checkpoint, and when it stops instead (the healed train.py runs are in tests/test_exact_resume.py)."""
from __future__ import annotations

import argparse
from pathlib import Path
import os
import types

import pytest

from slime.config import defaults_namespace
from slime.config.health import HealingPolicy
from slime.config.run_state import run_state_of
from slime.ray.driver.healing import (Failure, HealingRefusedError, RepeatedFailureError, Restart,
                                      SavedCheckpoint, plan_restart, train_with_healing)
from slime.ray.driver.rank_wait import RankFailedError
from slime.ray.rollout_manager.errors import EngineFailedError


def failure(rollout_id: int, ranks=(), nodes=(), role="actor") -> Failure:
    return Failure(cause=f"failed in rollout {rollout_id}", error="RankFailedError", rollout_id=rollout_id,
                   ranks=tuple(ranks), nodes=tuple(nodes), role=role)


def own(iteration: int) -> SavedCheckpoint:
    """A checkpoint this run saved."""
    return SavedCheckpoint(iteration=iteration, own=True, written_by="this-run")


def test_a_restart_goes_back_to_the_last_checkpoint_and_counts():
    policy = HealingPolicy(max_restarts=2)
    first = plan_restart(policy, (), failure(5, ranks=[1]), own(3), multi_node=False)
    assert (first.number, first.checkpoint) == (1, 3)
    second = plan_restart(policy, (first,), failure(7, ranks=[0]), own(6), multi_node=False)
    assert (second.number, second.checkpoint) == (2, 6)
    assert plan_restart(policy, (first, second), failure(8, ranks=[1]), own(7), multi_node=False) is None  # spent


def test_the_same_rank_twice_in_a_row_stops_the_run():
    policy = HealingPolicy(max_restarts=5)
    first = plan_restart(policy, (), failure(2, ranks=[1]), own(1), multi_node=False)
    with pytest.raises(RepeatedFailureError, match=r"rank\(s\) \[1\] failed again"):
        plan_restart(policy, (first,), failure(3, ranks=[0, 1]), own(2), multi_node=False)


def test_the_same_node_twice_stops_a_multi_node_run_only():
    policy = HealingPolicy(max_restarts=5)
    first = plan_restart(policy, (), failure(2, ranks=[0], nodes=["10.0.0.1"]), own(1), multi_node=True)
    with pytest.raises(RepeatedFailureError, match=r"node\(s\) \['10.0.0.1'\]"):
        plan_restart(policy, (first,), failure(3, ranks=[1], nodes=["10.0.0.1"]), own(2), multi_node=True)
    # one node: every failure is on it, so only a repeated rank stops the run
    assert plan_restart(policy, (first,), failure(3, ranks=[1], nodes=["10.0.0.1"]), own(2),
                        multi_node=False) is not None


def test_no_checkpoint_or_one_outside_the_window_is_a_named_refusal():
    with pytest.raises(HealingRefusedError, match="no complete checkpoint"):
        plan_restart(HealingPolicy(max_restarts=1), (), failure(0, ranks=[0]), None, multi_node=False)
    window = HealingPolicy(max_restarts=1, window_rollouts=2)
    with pytest.raises(HealingRefusedError,
                       match="3 rollouts before the failed rollout 7.*--restart-window-rollouts 2"):
        plan_restart(window, (), failure(7), own(3), multi_node=False)
    assert plan_restart(window, (), failure(7), own(4), multi_node=False).checkpoint == 4  # 2 rollouts lost: within


def run_args(tmp_path, max_restarts: int) -> argparse.Namespace:
    return defaults_namespace(max_restarts=max_restarts, restart_window_rollouts=None, save=str(tmp_path),
                              ledger_dir=None, load=None, finetune=True, start_rollout_id=0, run_id="this-run",
                              no_load_optim=False, no_load_rng=False, use_critic=False)


def publish(tmp_path, iteration: int, run_id: str | None = "this-run") -> None:
    """A checkpoint of `iteration` under --save, saved by run `run_id`."""
    from slime.checkpoint.contents import iteration_dir, write_manifest

    os.makedirs(iteration_dir(str(tmp_path), iteration), exist_ok=True)
    write_manifest(iteration_dir(str(tmp_path), iteration), ("model",), run_id)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def test_the_loop_resumes_from_save_and_stops_on_an_unnamed_error(tmp_path):
    args = run_args(tmp_path, max_restarts=3)
    seen = []

    def train(a):
        state = run_state_of(a)
        seen.append((a.load, a.start_rollout_id, a.finetune, state.restart_count, state.restart_checkpoint))
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
    assert seen == [(None, 0, True, 0, None), (str(tmp_path), None, False, 1, 1), (str(tmp_path), None, False, 2, 2)]
    assert (args.load, args.finetune, run_state_of(args).restart_count) == (None, True, 0)  # each attempt its own


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
    # its restarts would start a fresh optimizer
    (["--save", "/tmp/x", "--save-interval", "1", "--no-save-optim"], "with --no-save-optim: a restart would go back"),
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
    note_failure(error, 3, {"actor": ["10.0.0.1", "10.0.0.2"]})
    failure = failure_of(error, 0)
    assert (failure.ranks, failure.nodes, failure.rollout_id) == ((1,), ("10.0.0.2",), 3)


# ----------------------------------------------------------------------------- a restart goes only to this run's own
def test_a_checkpoint_another_run_saved_is_refused_naming_it():
    """--load A --save B, B's tracker from an older run, a failure before this run's first save: a restart would
    continue the older run's weights, optimizer and data position."""
    policy = HealingPolicy(max_restarts=3, window_rollouts=2)
    foreign = SavedCheckpoint(iteration=200, own=False, written_by="older-run")
    with pytest.raises(HealingRefusedError, match="iteration 200, which run older-run saved, not this run"):
        plan_restart(policy, (), failure(52), foreign, multi_node=False)
    with pytest.raises(HealingRefusedError, match="a run that did not record its id"):
        plan_restart(policy, (), failure(52), SavedCheckpoint(iteration=50, own=False), multi_node=False)
    with pytest.raises(HealingRefusedError, match="after the failed rollout 52"):
        plan_restart(policy, (), failure(52), own(60), multi_node=False)


def test_only_the_runs_own_or_starting_checkpoint_is_a_heal_target(tmp_path):
    from slime.checkpoint.contents import heal_target
    from slime.ray.driver.healing import saved_checkpoint

    assert saved_checkpoint(str(tmp_path), "this-run", None) is None  # no tracker yet
    publish(tmp_path, 4, run_id="older-run")
    assert saved_checkpoint(str(tmp_path), "this-run", None) == SavedCheckpoint(4, own=False, written_by="older-run")
    assert heal_target(str(tmp_path), "this-run") is None
    # the checkpoint this run resumed from (--load is --save) is one it may go back to
    assert heal_target(str(tmp_path), "this-run", started_from=4) == 4
    publish(tmp_path, 5)
    assert saved_checkpoint(str(tmp_path), "this-run", 4) == SavedCheckpoint(5, own=True, written_by="this-run")


def test_the_loop_refuses_to_heal_into_another_runs_checkpoint(tmp_path):
    args = run_args(tmp_path, max_restarts=2)
    args.load, args.finetune = str(tmp_path / "elsewhere"), False
    publish(tmp_path, 200, run_id="older-run")
    calls = []

    def train(a):
        calls.append(a.load)
        error = RankFailedError("phase 'actor_train': rank 0 exited", phase="actor_train", ranks=(0,))
        error.failed_rollout_id = 52
        raise error

    with pytest.raises(HealingRefusedError, match="iteration 200, which run older-run saved"):
        train_with_healing(train, args)
    assert calls == [str(tmp_path / "elsewhere")]


def test_a_run_resumed_from_its_save_directory_may_go_back_to_that_checkpoint(tmp_path):
    publish(tmp_path, 3, run_id="older-run")
    args = run_args(tmp_path, max_restarts=1)
    args.load, args.finetune, args.start_rollout_id = str(tmp_path), False, None
    seen = []

    def train(a):
        seen.append((a.load, run_state_of(a).restart_count, run_state_of(a).restart_checkpoint))
        if len(seen) == 1:
            error = TimeoutError("rollout 4 timed out")
            error.failed_rollout_id = 4  # as the session notes it
            raise error

    train_with_healing(train, args)
    assert seen == [(str(tmp_path), 0, None), (str(tmp_path), 1, 3)]


# ----------------------------------------------------------------------------- exact under every flag
def test_a_restart_loads_the_optimizer_rng_and_the_critics_own_saves(tmp_path):
    from slime.ray.driver.healing import resume_args

    args = defaults_namespace(ledger_dir=None, load="/A", save=str(tmp_path), finetune=True, start_rollout_id=51,
                              no_load_optim=True, no_load_rng=True, use_critic=True, critic_load="/C",
                              critic_save=None)
    resumed = resume_args(args, Restart(number=1, failure=failure(52), checkpoint=51))
    assert (resumed.load, resumed.finetune, resumed.no_load_optim, resumed.no_load_rng) == (str(tmp_path), False,
                                                                                             False, False)
    assert resumed.critic_load == str(tmp_path / "critic") and resumed.start_rollout_id is None  # not /C
    assert (args.load, args.critic_load, args.start_rollout_id) == ("/A", "/C", 51)  # the failed attempt's, kept
    state = run_state_of(resumed)
    assert (state.start_rollout_id, state.start_rollout_id_given, state.restart_count) == (None, False, 1)
    again = resume_args(defaults_namespace(**{**vars(resumed), "critic_save": "/D"}),
                        Restart(number=2, failure=failure(53), checkpoint=52))
    assert again.critic_load == "/D" and run_state_of(again).restart_checkpoint == 52


# ----------------------------------------------------------------------------- repeats by role and rank
def test_a_critic_rank_and_an_actor_rank_of_the_same_number_are_not_a_repeat():
    policy = HealingPolicy(max_restarts=3)
    first = plan_restart(policy, (), failure(5, ranks=[1], role="critic"), own(3), multi_node=False)
    assert plan_restart(policy, (first,), failure(5, ranks=[1], role="actor"), own(4), multi_node=False) is not None
    with pytest.raises(RepeatedFailureError, match=r"critic rank\(s\) \[1\] failed again"):
        plan_restart(policy, (first,), failure(5, ranks=[1], role="critic"), own(4), multi_node=False)


def test_a_critic_failure_blames_the_critics_node():
    from slime.ray.driver.healing import failure_of, note_failure

    error = RankFailedError("phase 'critic_train': rank 1 exited", phase="critic_train", ranks=(1,), role="critic")
    note_failure(error, 3, {"actor": ["10.0.0.1", "10.0.0.1"], "critic": ["10.0.0.7", "10.0.0.8"]})
    assert (failure_of(error, 0).role, failure_of(error, 0).nodes) == ("critic", ("10.0.0.8",))


# ----------------------------------------------------------------------------- nothing left behind
def test_a_restart_moves_the_critics_stack_files_aside_and_keeps_the_engines_logs(tmp_path):
    from slime.ray.driver.healing import archive_ledger

    (tmp_path / "critic").mkdir()
    (tmp_path / "critic" / "stacks_rank1.txt").write_text("HANG: phase=critic_train stuck ranks=[1]\n")
    (tmp_path / "engine-logs").mkdir()
    (tmp_path / "engine-logs" / "engine0.log").write_text("serving")
    archive_ledger(str(tmp_path), 1)
    assert not (tmp_path / "critic" / "stacks_rank1.txt").exists()  # no stale verdict for the next attempt's critic
    assert (tmp_path / "attempt1" / "critic" / "stacks_rank1.txt").exists()
    assert (tmp_path / "engine-logs" / "engine0.log").read_text() == "serving"
    archive_ledger(str(tmp_path), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt1", "attempt2", "engine-logs"]


def test_a_healed_run_removes_the_temp_ledger_dir_it_made(tmp_path):
    from slime.ray.driver.trainer_group import remove_temp_ledger_dir, resolve_ledger_dir

    args = defaults_namespace(ledger_dir=None)
    made = resolve_ledger_dir(args)  # the first session
    assert resolve_ledger_dir(args) == made  # the restarted session's
    remove_temp_ledger_dir(args)  # the run ended cleanly
    assert not os.path.exists(made)


def test_a_rank_group_that_fails_to_start_its_ranks_ends_its_hub(monkeypatch):
    from slime.ray.driver import trainer_group

    killed = []
    monkeypatch.setattr(trainer_group, "start_hub", lambda world, runtime_env=None: ("hub", "name"))
    monkeypatch.setattr(trainer_group, "HubClient", lambda transport: types.SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(trainer_group, "RayHub", lambda *hub: None)
    monkeypatch.setattr(trainer_group.ray, "kill", lambda actor, no_restart: killed.append(actor))

    def refuse(**options):
        raise ValueError("no such bundle")

    monkeypatch.setattr(trainer_group.ray, "remote", lambda cls: types.SimpleNamespace(options=refuse))
    layout = types.SimpleNamespace(world_size=2)
    args = defaults_namespace(ledger_dir="/tmp", run_config=types.SimpleNamespace(layout=layout, deadlines=None))
    with pytest.raises(ValueError, match="no such bundle"):
        trainer_group.RayTrainGroup(args, types.SimpleNamespace(trainer_options=lambda rank, role: {}))
    assert killed == ["hub"]


# ----------------------------------------------------------------------------- engines kept through a trainer heal
class KeepingRollout:
    """The rollout manager's proxy as the session sees it, recording what happens to the engines."""

    def __init__(self, log: list, kept):
        self.log, self.kept = log, kept
        log.append("manager starts, adopting the kept engines" if kept else "manager starts new engines")

    def num_prompts(self):
        return 8

    def engine_urls(self):
        return ["http://engine"]

    def engine_endpoints(self):
        return []

    def attach_trainer(self, push):
        pass

    def generate(self, rollout_id):
        self.log.append(f"generate {rollout_id}")
        return object(), {}

    def engines_for_sync(self):
        return None

    def weights_pushed(self, urls, version):
        pass

    def keep_engines(self):
        self.log.append("engines kept")
        return "kept engines"

    def shutdown(self):
        self.log.append("engines stop")


class FailingTrainers:
    """Trainer ranks whose first attempt fails once in `phase` of rollout 1."""

    failed = False

    def __init__(self, log: list, save: str, phase: str):
        self.log, self.save_dir, self.phase = log, save, phase

    def where(self):
        return []

    def init(self, urls):
        self.log.append("trainer build")

    def _maybe_fail(self, phase: str, rollout_id: int):
        if phase == self.phase and rollout_id == 1 and not FailingTrainers.failed:
            FailingTrainers.failed = True
            raise RankFailedError(f"phase '{phase}': rank 0 exited", phase=phase, ranks=(0,))

    def train(self, rollout_id, data_ref):
        self._maybe_fail("actor_train", rollout_id)
        self.log.append(f"train {rollout_id}")
        return {}

    def save(self, rollout_id):
        publish(Path(self.save_dir), rollout_id, run_id="this-run")

    def update_weights(self, rollout_id, engine_urls=None):
        self._maybe_fail("weight_sync", rollout_id)
        self.log.append(f"push version {rollout_id + 1}")
        return {}

    def shutdown(self):
        self.log.append("trainer stop")


@pytest.mark.parametrize("phase, flags, kept", [
    ("actor_train", [], True),  # the trainer alone failed: the engines serve on
    ("weight_sync", [], False),  # an engine may be mid-update: new engines
    ("actor_train", ["--restart-engines-on-heal"], False),
])
def test_a_trainer_heal_keeps_the_engines_and_their_bundles(monkeypatch, tmp_path, phase, flags, kept):
    import train as train_module
    from arg_testing import parse_quiet
    from slime.ray.driver import session

    log = []
    FailingTrainers.failed = False
    placement = types.SimpleNamespace(layout=types.SimpleNamespace(engines=("engine 0",)),
                                      remove=lambda: log.append("bundles removed"))
    monkeypatch.setattr(session, "init_ray", lambda args: None)
    monkeypatch.setattr(session, "create_placement", lambda args: log.append("bundles placed") or placement)
    monkeypatch.setattr(session, "create_rollout_manager",
                        lambda args, placement, kept=None: KeepingRollout(log, kept))
    monkeypatch.setattr(session, "RayTrainGroup", lambda args, placement: FailingTrainers(log, str(tmp_path), phase))
    monkeypatch.setattr(session, "KeptServing", lambda placement, engines: types.SimpleNamespace(
        placement=placement, engines=engines, stop=lambda: log.append("kept engines stop")))
    args = parse_quiet(["--rollout-batch-size", "2", "--num-rollout", "3", "--actor-num-gpus-per-node", "1",
                        "--train-backend-device", "cpu", "--hf-checkpoint", str(tmp_path), "--rollout-num-gpus", "1",
                        "--save", str(tmp_path), "--save-interval", "1", "--max-restarts", "1",
                        "--data-source-path", "slime.rollout.data_source.RolloutDataSource",  # no data file to check
                        "--ledger-dir", str(tmp_path / "ledger"), *flags])
    args.run_id = "this-run"
    train_with_healing(train_module.train, args)
    failed_at = log.index("trainer stop")
    before, after = log[:failed_at], log[failed_at + 1:]
    assert before.count("bundles placed") == 1 and "push version 1" in before
    if kept:
        assert before[-1] == "engines kept" and "engines stop" not in before and "bundles removed" not in before
        assert after[:2] == ["manager starts, adopting the kept engines", "trainer build"]  # no new bundles
    else:
        assert before[-1] == "engines stop" and after[0] == "bundles removed"
        assert after[1:4] == ["bundles placed", "manager starts new engines", "trainer build"]
    assert after[-3:] == ["engines stop", "trainer stop", "bundles removed"]
    assert "push version 2" in after and "train 2" in after  # it ran on to the end from checkpoint 0


def test_kept_engines_released_by_the_failed_session_are_not_released_again():
    """Colocated: the trainer failed while the engines had released their memory. The next session's manager knows
    it (SGLang refuses to resume a tag it holds and must not release one twice): its release before the trainer is
    built does nothing, and the resumes around the first push resume each tag once."""
    from slime.ray.rollout_manager.manager import RolloutManager

    calls = []

    class Client:
        def release_memory_occupation(self, tags):
            calls.append(("release", tags))

        def resume_memory_occupation(self, tags):
            calls.append(("resume", tags))

        def server_info(self):
            return {}

    manager = RolloutManager.__new__(RolloutManager)  # its memory bookkeeping alone, without engines
    manager.released = {"weights", "kv_cache", "cuda_graph"}  # as the kept engines were handed over
    manager._each_engine = lambda call: [call(Client())]
    assert manager.offload() == {} and calls == []
    manager.onload(("weights",))
    manager.onload(None)
    manager.onload(None)
    assert calls == [("resume", ["weights"]), ("resume", ["kv_cache", "cuda_graph"])]
    manager.offload()
    assert calls[-1] == ("release", ["weights", "kv_cache", "cuda_graph"]) and manager.released == set(calls[-1][1])
