"""train_async.py's schedule (slime/ray/driver/async_schedule.py): the plan as data, the loop's order call by call, and
the refusals. Recorders stand in for the rollout manager and the trainer group (pure loop logic; the real
components run this order in tests/test_train_async_e2e.py)."""
from __future__ import annotations

import os
import tempfile
import types

import pytest

import train_async
from slime.ray.driver import session
from arg_testing import driver_args, no_real_sglang, parse_error  # noqa: F401 - the fixture applies to every test here
from slime.ray.driver.async_schedule import OneStepOffPlan, check_async_args
from slime.ray.common.engine_slot import EngineSlot
from slime.ray.common.node import PlacementError
from slime.ray.driver.placement import BundleInfo, Layout, check_disjoint, plan_layout
from slime.ray.rollout_manager.errors import EngineFailedError
from slime.ray.driver.rollout_wait import EngineTargets
from slime.utils.arguments import ArgumentValidationError


# ----- the plan -----------------------------------------------------------------------------------
def _timeline(**kwargs) -> list[tuple[int, int, int, bool]]:
    return [(s.rollout_id, s.generated_with, s.trained_at, s.push_after) for s in OneStepOffPlan(**kwargs).steps()]


def test_one_step_off_every_rollout_after_the_first_is_generated_one_version_behind():
    assert _timeline(start_rollout_id=0, num_rollout=4) == [
        (0, 0, 0, True), (1, 0, 1, True), (2, 1, 2, True), (3, 2, 3, True)]


def test_an_interval_of_two_pushes_every_other_rollout_and_staleness_alternates():
    steps = OneStepOffPlan(start_rollout_id=0, num_rollout=6, update_weights_interval=2).steps()
    assert [(s.generated_with, s.push_after) for s in steps] == [
        (0, False), (0, True), (0, False), (2, True), (2, False), (4, True)]
    assert [s.staleness for s in steps] == [0, 1, 2, 1, 2, 1]


def test_a_resumed_run_starts_from_the_version_it_pushes_at_start():
    assert _timeline(start_rollout_id=5, num_rollout=7) == [(5, 5, 5, True), (6, 5, 6, True)]


@pytest.mark.parametrize("interval", [1, 2, 3])
def test_a_run_resumed_with_the_engines_weights_generates_every_rollout_with_the_uninterrupted_version(interval):
    """From a checkpoint saved after rollout S-1 with the weights the engines held (version E), the resumed plan is
    the uninterrupted one from rollout S on; from the trainer's weights (version S) alone it is not."""
    uninterrupted = OneStepOffPlan(start_rollout_id=0, num_rollout=8, update_weights_interval=interval).steps()
    for start in range(1, 8):
        served = uninterrupted[start].generated_with
        resumed = OneStepOffPlan(start_rollout_id=start, num_rollout=8, update_weights_interval=interval,
                                 start_version=served)
        assert resumed.steps() == uninterrupted[start:], (start, served)
        assert resumed.replays_push == (served != start and (start % interval == 0))
    assert OneStepOffPlan(start_rollout_id=3, num_rollout=8).steps()[0].generated_with == 3 != uninterrupted[3]


# ----- the loop, call by call ---------------------------------------------------------------------
class Log(list):
    pass


class FakeWatch:
    def __init__(self, log: Log, rollout_id: int, targets: EngineTargets, *, fail: bool, restarted: list[str]):
        self.log, self.rollout_id, self.targets = log, rollout_id, targets
        self.fail = fail
        self.waiting_for_weights = list(restarted)
        self.done = False

    def poll(self, timeout_s=1.0, *, can_push=True):
        if self.fail:
            raise EngineFailedError(f"engine 1 died while rollout {self.rollout_id} generated")
        if self.waiting_for_weights and can_push:
            version = self.targets.catch_up(self.waiting_for_weights)
            self.log.append(f"engine caught up at version {version}")
            self.waiting_for_weights = []
        if not self.waiting_for_weights and not self.done:
            self.done = True
            self.log.append(f"generate {self.rollout_id} done")
        return self.done

    def result(self):
        while not self.poll():
            pass
        return f"data{self.rollout_id}", {"rollout/raw_reward": 0.0}


class FakeRollout:
    def __init__(self, log: Log, *, fail_rollout=None, restart_in=None, fail_start=False):
        if fail_start:
            raise EngineFailedError("engine 0 did not start")
        self.log = log
        self.targets = EngineTargets()
        self.version = None
        self.fail_rollout, self.restart_in = fail_rollout, restart_in

    def num_prompts(self):
        return 8

    def engine_urls(self):
        return ["http://e0", "http://e1"]

    def engine_endpoints(self):
        return []

    def attach_trainer(self, push):
        self.targets.push = push

    def start_generate(self, rollout_id):
        self.log.append(f"generate {rollout_id} starts at version {self.version}")
        return FakeWatch(self.log, rollout_id, self.targets, fail=rollout_id == self.fail_rollout,
                         restarted=["http://e1b"] if rollout_id == self.restart_in else [])

    @staticmethod
    def collect(watch):
        return watch.result()

    def hold_generation(self):
        self.log.append("hold")
        return {"weight_sync/held_requests": 0.0}

    def release_generation(self):
        self.log.append("release")

    def engines_for_sync(self):
        return None

    def weights_pushed(self, urls, version):
        self.version = version
        self.targets.pushed(urls or [], version)

    def evaluate(self, rollout_id):
        return {}

    def shutdown(self):
        self.log.append("engines stop")


class FakeTrainers:
    def __init__(self, log: Log):
        self.log = log

    def where(self):
        return []

    def init(self, urls):
        self.log.append("trainer build")

    def train(self, rollout_id, data_ref, on_poll=None):
        self.log.append(f"train {rollout_id} on {data_ref}")
        if on_poll is not None:
            on_poll()  # the next rollout is watched while this one trains
        return {"train/loss": 0.0}

    def save(self, rollout_id):
        self.log.append(f"save {rollout_id}")

    def update_weights(self, rollout_id, engine_urls=None, served=False, keep_served=False):
        self.log.append(f"push version {rollout_id + 1}" + (f" to {engine_urls}" if engine_urls else "")
                        + (" (the checkpoint's copy)" if served else "") + (", copy kept" if keep_served else ""))
        return {"weight_sync/version": rollout_id + 1}

    def shutdown(self):
        self.log.append("trainer stop")


class Metrics:
    def __init__(self, args):
        self.events = []

    def log(self, kind, step, values):
        self.events.append((kind, step, values))

    def rollout_done(self, rollout_id):
        self.events.append(("done", rollout_id, {}))

    def close(self):
        pass


def run_loop(monkeypatch, rollout_options=None, log=None, **flags):
    log = Log() if log is None else log
    metrics = {}
    monkeypatch.setattr(session, "init_ray", lambda args: None)
    monkeypatch.setattr(session, "create_placement", lambda args: types.SimpleNamespace(layout=Layout(
        actor_bundles=(), engines=()), remove=lambda: log.append("bundles released")))
    monkeypatch.setattr(session, "create_rollout_manager",
                        lambda args, placement: FakeRollout(log, **(rollout_options or {})))
    monkeypatch.setattr(session, "RayTrainGroup", lambda args, placement: FakeTrainers(log))
    monkeypatch.setattr(session, "MetricsLogger", lambda args, console: metrics.setdefault("logger", Metrics(args)))
    defaults = dict(load=None, num_rollout=3, num_epoch=None, rollout_batch_size=4, debug_rollout_only=False,
                    debug_train_only=False, offload_train=False, offload_rollout=False, colocate=False,
                    rollout_num_gpus=2, update_weights_interval=1, eval_interval=None, eval_prompt_data=None,
                    save=None, save_interval=None, start_rollout_id=None, ledger_dir=tempfile.gettempdir(), verbose=False,
                    use_critic=False, restart_count=0)
    args = driver_args(**{**defaults, **flags})
    try:
        train_async.train(args)
    finally:
        log.events = metrics["logger"].events if "logger" in metrics else []
    return log


def test_the_next_rollout_generates_while_this_one_trains_and_pushes_wait_for_it(monkeypatch):
    log = run_loop(monkeypatch)
    assert log == [
        "trainer build", "hold", "push version 0", "release",  # the engines start from the trainer's weights
        "generate 0 starts at version 0", "generate 0 done",
        "generate 1 starts at version 0", "train 0 on data0", "generate 1 done",
        "hold", "push version 1", "release",
        "generate 2 starts at version 1", "train 1 on data1", "generate 2 done",
        "hold", "push version 2", "release",
        "train 2 on data2", "hold", "push version 3", "release",
        "engines stop", "trainer stop", "bundles released",  # last: a restart places the job anew
    ]
    train_events = {step: values for kind, step, values in log.events if kind == "train"}
    assert [(v["train/rollout_weight_version"], v["train/trainer_weight_version"]) for v in train_events.values()] == [
        (0.0, 0.0), (0.0, 1.0), (1.0, 2.0)]
    kinds = [(kind, step) for kind, step, _ in log.events if kind in ("train", "weight_sync", "done") and step >= 0]
    assert kinds == [(kind, r) for r in range(3) for kind in ("train", "weight_sync", "done")]  # a line per rollout


def test_with_an_interval_of_two_the_engines_keep_a_version_for_two_rollouts(monkeypatch):
    log = run_loop(monkeypatch, num_rollout=4, update_weights_interval=2)
    assert [c for c in log if c.startswith("push")] == ["push version 0", "push version 2", "push version 4"]
    assert [c for c in log if c.startswith("generate") and "starts" in c] == [
        "generate 0 starts at version 0", "generate 1 starts at version 0", "generate 2 starts at version 0",
        "generate 3 starts at version 2"]


def test_a_rollout_that_fails_while_the_trainer_trains_stops_the_run_at_once(monkeypatch):
    with pytest.raises(EngineFailedError, match="rollout 1"):
        run_loop(monkeypatch, rollout_options={"fail_rollout": 1})


def test_a_failed_start_gives_back_what_it_took(monkeypatch):
    """A session that fails while starting stops what it started (--max-restarts then starts it all again)."""
    log = Log()
    with pytest.raises(EngineFailedError, match="did not start"):
        run_loop(monkeypatch, rollout_options={"fail_start": True}, log=log)
    assert log == ["bundles released"]  # placed, no engine started, no trainer built


def test_an_engine_restarted_during_training_is_caught_up_once_the_trainer_is_free(monkeypatch):
    log = run_loop(monkeypatch, rollout_options={"restart_in": 1})
    train0 = log.index("train 0 on data0")
    catch_up = log.index("push version 1 to ['http://e1b']")  # the trainer's version after training rollout 0
    assert train0 < catch_up < log.index("engine caught up at version 1") < log.index("generate 1 done")


# ----- refusals -----------------------------------------------------------------------------------
def _async_args(**flags):
    base = dict(colocate=False, offload_train=False, offload_rollout=False, debug_train_only=False,
                debug_rollout_only=False, rollout_num_gpus=2)
    return types.SimpleNamespace(**{**base, **flags})


@pytest.mark.parametrize("flags, says", [
    ({"colocate": True}, "--colocate is not supported by train_async.py"),
    ({"offload_rollout": True}, "--offload-rollout"),
    ({"debug_train_only": True}, "run train.py --debug-train-only"),
    ({"rollout_num_gpus": None}, "--rollout-num-gpus"),
])
def test_what_train_async_cannot_run_is_refused_with_the_reason(flags, says):
    with pytest.raises(ArgumentValidationError, match=says):
        check_async_args(_async_args(**flags))


MINIMAL = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
           "--train-backend-device", "cpu"]


def test_train_async_colocate_exits_with_the_reason(capsys):
    code = train_async.main([*MINIMAL, "--colocate"])
    assert code == 2
    assert "engines and trainer cannot share GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "two"])
def test_an_update_weights_interval_that_is_not_a_positive_integer_is_refused(value, capsys):
    message = parse_error([*MINIMAL, "--update-weights-interval", value], capsys)
    assert "--update-weights-interval" in message and "is not a positive integer" in message


def test_trainer_and_engine_bundles_that_overlap_are_refused():
    bundles = tuple(BundleInfo(index=i, node_id="n", node_ip="127.0.0.1") for i in range(4))
    check_disjoint(plan_layout(bundles, trainer_ranks=2, num_engines=2, gpus_per_engine=1, colocate=False))
    shared = Layout(actor_bundles=bundles[:2], engines=(EngineSlot(rank=0, bundles=(1,), node_id="n",
                                                                    node_ip="127.0.0.1"),))
    with pytest.raises(PlacementError, match=r"share bundle 1 \(engine 0\).*bundles of its own"):
        check_disjoint(shared)


def test_train_py_refuses_an_interval_it_would_ignore(capsys):
    import train as train_module

    assert train_module.main([*MINIMAL, "--update-weights-interval", "2"]) == 2
    assert "is train_async.py's" in capsys.readouterr().err


def test_a_negative_staleness_bound_is_refused(capsys):
    message = parse_error([*MINIMAL, "--max-weight-staleness", "-1"], capsys)
    assert "--max-weight-staleness" in message and "is not a non-negative integer" in message


def _checkpoint_with_served_weights(root, iteration: int, version: int) -> str:
    from slime.checkpoint import contents

    path = contents.iteration_dir(str(root), iteration)
    os.makedirs(contents.served_dir(path))
    contents.write_manifest(path, ("model", "optimizer", "scheduler", "rng", "served"))
    contents.write_served_version(path, version)
    (root / contents.TRACKER).write_text(str(iteration))
    return str(root)


def test_a_resumed_run_pushes_the_engines_weights_of_the_checkpoint_and_replays_the_push_after_it(monkeypatch,
                                                                                                  tmp_path):
    """What the engines generate with, and what is pushed, from rollout 3 on, is the uninterrupted run's; every
    push followed by a save keeps a copy of what it pushed (saved as the engines' weights)."""
    def timeline(log, start):
        return [c for c in log if (c.startswith("push") or ("starts" in c and int(c.split()[1]) >= start))]

    uninterrupted = run_loop(monkeypatch, num_rollout=5, save=str(tmp_path / "a"), save_interval=1)
    assert "push version 2, copy kept" in uninterrupted  # saved after training rollout 2: the engines hold 2
    load = _checkpoint_with_served_weights(tmp_path / "b", 2, 2)
    resumed = run_loop(monkeypatch, num_rollout=5, load=load, start_rollout_id=3, save=load, save_interval=1)
    assert timeline(resumed, 3)[:4] == ["push version 2 (the checkpoint's copy)", "generate 3 starts at version 2",
                                        "push version 3, copy kept", "generate 4 starts at version 3"]
    assert timeline(resumed, 3)[1:] == timeline(uninterrupted, 3)[timeline(uninterrupted, 3).index(
        "generate 3 starts at version 2"):]
    train = {step: v for kind, step, v in resumed.events if kind == "train"}
    assert [train[k]["train/rollout_weight_version"] for k in (3, 4)] == [2.0, 3.0]
