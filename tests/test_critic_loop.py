"""train.py's and train_async.py's loops with a critic (--advantage-estimator ppo), checked call by call with
recorders standing in for the rollout manager and both trainer groups: the critic values each rollout before either
role trains, its values reach the critic's and the actor's step, --num-critic-only-steps trains the critic only
(train.py: the actor sleeps, no weight push, the engines keep their weights; train_async.py: its pushes go on) and
both roles save and sleep, the critic's save before the actor's and its tracker after (a run stopped in between
resumes both at the actor's iteration)."""
from __future__ import annotations

import tempfile

import ray

import train as train_module
from arg_testing import driver_args
from slime.ray.driver import session
from test_colocate_loop import FakeRollout, FakeTrainers, Recorder


class FakeGroup(FakeTrainers):
    def __init__(self, log: Recorder, role: str):
        super().__init__(log)
        self.role = role

    def _say(self, what: str) -> None:
        self.log.calls.append(f"{self.role} {what}")

    def init(self, urls):
        self._say(f"build, engines {urls}")

    def sleep(self):
        self._say("sleep")
        return {"memory/trainer_asleep_reserved_gb": 0.0}

    def values(self, rollout_id, data_ref, on_poll=None):
        self._say(f"values {rollout_id}")
        return ray.put({"values": [[float(rollout_id)]]})  # a reference, as critic rank 0 returns it

    def train(self, rollout_id, data_ref, on_poll=None, extra_refs=()):
        self._say(f"train {rollout_id} with {[ray.get(r) for r in extra_refs]}")
        return {f"{self.role}/loss": 0.0}

    def save(self, rollout_id, publish=True):
        self._say(f"save {rollout_id}" + ("" if publish else ", tracker left"))

    def publish(self, rollout_id):
        self._say(f"publish {rollout_id}")

    def update_weights(self, rollout_id, engine_urls=None, *, served=False, keep_served=None):
        self.log.calls.append(f"push version {rollout_id + 1}")
        return {"weight_sync/version": rollout_id + 1}

    def shutdown(self):
        self._say("stop")


def run_ppo_loop(monkeypatch, **flags) -> list[str]:
    log = Recorder()
    monkeypatch.setattr(session, "init_ray", lambda args: None)
    monkeypatch.setattr(session, "create_placement", lambda args: None)
    monkeypatch.setattr(session, "create_rollout_manager", lambda args, placement: FakeRollout(log))
    monkeypatch.setattr(session, "RayTrainGroup", lambda args, placement, role="actor": FakeGroup(log, role))
    monkeypatch.setattr(ray, "put", lambda value: value)
    monkeypatch.setattr(ray, "get", lambda value: value)
    defaults = dict(load=None, num_rollout=3, num_epoch=None, rollout_batch_size=4, debug_rollout_only=False,
                    debug_train_only=False, offload_train=True, offload_rollout=True, eval_interval=None,
                    eval_prompt_data=None, save="/tmp/ckpt", save_interval=2, metrics_jsonl=None, use_wandb=False,
                    use_tensorboard=False, tensorboard_dir=None, start_rollout_id=None,
                    ledger_dir=tempfile.gettempdir(), verbose=False, use_critic=True, num_critic_only_steps=1,
                    restart_count=0)
    train_module.train(driver_args(**{**defaults, **flags}))
    return log.calls


def test_the_critic_values_and_trains_first_and_the_actor_waits_out_the_critic_only_rollouts(monkeypatch):
    assert run_ppo_loop(monkeypatch) == [
        "engines release all",
        "actor build, engines ['http://engine']", "critic build, engines []",  # the critic pushes no weights
        "actor sleep", "critic sleep",
        "engines resume weights", "push version 0", "engines resume rest",
        # rollout 0: critic only: the actor neither trains nor wakes, nothing is pushed
        "generate 0", "engines release all", "critic values 0", "critic train 0 with [{'values': [[0.0]]}]",
        "critic sleep", "engines resume rest",
        # rollout 1: the values reach both roles; both save (--save-interval 2) while awake, then sleep
        "generate 1", "engines release all", "critic values 1", "critic train 1 with [{'values': [[1.0]]}]",
        "actor train 1 with [{'values': [[1.0]]}]", "critic save 1, tracker left", "actor save 1", "critic publish 1",
        "actor sleep", "critic sleep",
        "engines resume weights", "push version 2", "engines resume rest",
        "generate 2", "engines release all", "critic values 2", "critic train 2 with [{'values': [[2.0]]}]",
        "actor train 2 with [{'values': [[2.0]]}]", "critic save 2, tracker left", "actor save 2", "critic publish 2",
        "actor sleep", "critic sleep",
        "engines resume weights", "push version 3", "engines resume rest",
        "engines stop", "actor stop", "critic stop",
    ]



class AsyncGroup(FakeGroup):
    """A trainer group of train_async.py's loop: it polls the next rollout's generation while it trains."""

    def train(self, rollout_id, data_ref, on_poll=None, extra_refs=()):
        on_poll()
        return super().train(rollout_id, data_ref, extra_refs=extra_refs)


def test_train_async_hands_the_critics_values_to_both_roles_while_the_next_rollout_generates(monkeypatch):
    import types

    import train_async
    from slime.ray.driver.placement import Layout
    from test_async_schedule import FakeRollout as AsyncRollout, Log, Metrics

    log = Log()
    monkeypatch.setattr(session, "init_ray", lambda args: None)
    monkeypatch.setattr(session, "create_placement",
                        lambda args: types.SimpleNamespace(layout=Layout(actor_bundles=(), engines=()),
                                                           remove=lambda: None))
    monkeypatch.setattr(session, "create_rollout_manager", lambda args, placement: AsyncRollout(log))
    monkeypatch.setattr(session, "RayTrainGroup",
                        lambda args, placement, role="actor": AsyncGroup(types.SimpleNamespace(calls=log), role))
    monkeypatch.setattr(session, "MetricsLogger", lambda args, console: Metrics(args))
    monkeypatch.setattr(ray, "put", lambda value: value)
    monkeypatch.setattr(ray, "get", lambda value: value)
    train_async.train(driver_args(
        load=None, num_rollout=2, num_epoch=None, rollout_batch_size=4, debug_rollout_only=False,
        debug_train_only=False, offload_train=False, offload_rollout=False, colocate=False, rollout_num_gpus=2,
        update_weights_interval=1, eval_interval=None, eval_prompt_data=None, save="/tmp/ckpt", save_interval=2,
        start_rollout_id=None, ledger_dir=tempfile.gettempdir(), verbose=False, use_critic=True,
        num_critic_only_steps=1, restart_count=0))
    trained = [line for line in log if any(f" {what} " in line for what in ("values", "train", "save", "publish"))]
    assert trained == [
        "critic values 0", "critic train 0 with [{'values': [[0.0]]}]",  # critic only: the actor waits
        "critic values 1", "critic train 1 with [{'values': [[1.0]]}]", "actor train 1 with [{'values': [[1.0]]}]",
        "critic save 1, tracker left", "actor save 1", "critic publish 1",
    ]
    assert "push version 2" in log  # the schedule's pushes go on (unchanged weights during the critic-only ones)
