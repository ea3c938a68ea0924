"""The colocated loop's order of memory hand-offs (train.py), checked call by call.

A recorder stands in for the rollout manager and the trainer group (pure loop logic; the real
components run this order in the end-to-end tests): at every moment one side owns the devices.
"""
from __future__ import annotations

import tempfile
import types

import pytest

import train as train_module
from arg_testing import driver_args
from slime.ray.driver import session


class Recorder:
    def __init__(self):
        self.calls: list[str] = []


class FakeRollout:
    def __init__(self, log: Recorder):
        self.log = log

    def num_prompts(self):
        return 8

    def engine_urls(self):
        return ["http://engine"]

    def engine_endpoints(self):
        return []

    def generate(self, rollout_id):
        self.log.calls.append(f"generate {rollout_id}")
        return object(), {"rollout/raw_reward": 0.0}

    def offload(self):
        self.log.calls.append("engines release all")
        return {"memory/engine0_released_reserved_gb": 0.0}

    def onload(self, tags):
        self.log.calls.append(f"engines resume {','.join(tags) if tags else 'rest'}")

    def evaluate(self, rollout_id):
        return {}

    def attach_trainer(self, push):
        pass

    def engines_for_sync(self):
        return None  # the engines of the last push (none was restarted)

    def weights_pushed(self, urls, version):
        pass

    def shutdown(self):
        self.log.calls.append("engines stop")


class FakeTrainers:
    def __init__(self, log: Recorder):
        self.log = log

    def where(self):
        return []

    def init(self, urls):
        self.log.calls.append("trainer build")

    def sleep(self):
        self.log.calls.append("trainer sleep")
        return {"memory/trainer_asleep_reserved_gb": 0.0}

    def train(self, rollout_id, data_ref):
        self.log.calls.append(f"train {rollout_id}")
        return {"train/loss": 0.0}

    def save(self, rollout_id):
        self.log.calls.append(f"save {rollout_id}")

    def update_weights(self, rollout_id, engine_urls=None):
        self.log.calls.append(f"push version {rollout_id + 1}")
        return {"weight_sync/version": rollout_id + 1}

    def shutdown(self):
        self.log.calls.append("trainer stop")


def run_loop(monkeypatch, **flags) -> list[str]:
    log = Recorder()
    monkeypatch.setattr(session, "init_ray", lambda args: None)
    monkeypatch.setattr(session, "create_placement", lambda args: None)
    monkeypatch.setattr(session, "create_rollout_manager", lambda args, placement: FakeRollout(log))
    monkeypatch.setattr(session, "RayTrainGroup", lambda args, placement: FakeTrainers(log))
    defaults = dict(load=None, num_rollout=2, num_epoch=None, rollout_batch_size=4, debug_rollout_only=False,
                    debug_train_only=False, offload_train=True, offload_rollout=True, eval_interval=None,
                    eval_prompt_data=None, save=None, save_interval=None, metrics_jsonl=None, use_wandb=False,
                    use_tensorboard=False, tensorboard_dir=None, start_rollout_id=None,
                    ledger_dir=tempfile.gettempdir(), verbose=False, use_critic=False, restart_count=0)
    train_module.train(driver_args(**{**defaults, **flags}))
    return log.calls


def test_colocated_order_gives_each_device_to_one_side_at_a_time(monkeypatch):
    assert run_loop(monkeypatch) == [
        "engines release all",   # before the trainer is built: the engines' memory is free for it
        "trainer build",
        "trainer sleep",         # asleep before the first generation
        "engines resume weights",
        "push version 0",        # the trainer's (possibly resumed) weights reach the engines
        "engines resume rest",
        "generate 0", "engines release all", "train 0", "trainer sleep",
        "engines resume weights", "push version 1", "engines resume rest",
        "generate 1", "engines release all", "train 1", "trainer sleep",
        "engines resume weights", "push version 2", "engines resume rest",
        "engines stop", "trainer stop",
    ]


def test_without_offload_nothing_is_released_and_the_trainer_stays_awake(monkeypatch):
    calls = run_loop(monkeypatch, offload_train=False, offload_rollout=False, num_rollout=1)
    assert calls == ["trainer build", "push version 0", "generate 0", "train 0", "push version 1",
                     "engines stop", "trainer stop"]


def test_a_save_happens_while_the_trainer_is_awake(monkeypatch):
    calls = run_loop(monkeypatch, save="/tmp/ckpt", save_interval=1, num_rollout=1)
    assert calls.index("save 0") == calls.index("train 0") + 1
    assert calls.index("save 0") < calls.index("trainer sleep", calls.index("train 0"))


def test_auto_backend_refuses_the_embedded_fallback_on_a_gpu_machine(monkeypatch):
    import importlib.util

    import torch

    from slime.backends.sglang_utils.launcher import pick_rollout_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match="--rollout-backend embedded"):
        pick_rollout_backend(types.SimpleNamespace(rollout_backend="auto"))
    assert pick_rollout_backend(types.SimpleNamespace(rollout_backend="embedded")) == "embedded"
