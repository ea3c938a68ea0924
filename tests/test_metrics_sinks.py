"""The driver's metrics sinks start within a deadline: a wandb that never answers ends the run with what to do."""
from __future__ import annotations

import sys
import threading
import types

import pytest

from slime.utils import metrics_logger


def _fake_wandb(init):
    return types.SimpleNamespace(login=lambda key: None, init=init, log=lambda *a, **k: None)


def _logger():
    args = types.SimpleNamespace(wandb_key=None, wandb_project="p", wandb_group="g", use_wandb=True, verbose=False,
                                 metrics_jsonl=None, use_tensorboard=False, tensorboard_dir=None)
    logger = metrics_logger.MetricsLogger(args, console=metrics_logger.Console(args, out=lambda line: None))
    logger.close()
    return logger


def test_a_hanging_wandb_init_is_named_within_its_deadline(monkeypatch):
    release = threading.Event()
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(lambda **kwargs: release.wait()))
    monkeypatch.setattr(metrics_logger, "WANDB_INIT_S", 0.3)
    monkeypatch.setattr(metrics_logger, "public_config", lambda args: {})
    try:
        with pytest.raises(SystemExit, match=r"--use-wandb: wandb.init .* did not return within 0s: .*WANDB_MODE=offline"):
            _logger()
    finally:
        release.set()


def test_wandb_init_errors_reach_the_driver_and_a_quick_init_opens_the_sink(monkeypatch):
    def refuse(**kwargs):
        raise PermissionError("bad key")

    monkeypatch.setattr(metrics_logger, "public_config", lambda args: {})
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(refuse))
    with pytest.raises(PermissionError, match="bad key"):
        _logger()
    started = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(lambda **kwargs: started.append(kwargs)))
    _logger()
    assert started[0]["project"] == "p"


class _StepKeepingWandb:
    """wandb's step rule: a log below the run's current step is dropped (with a warning)."""

    def __init__(self):
        self.run = types.SimpleNamespace(step=0)
        self.kept: list[tuple[int, dict]] = []

    def login(self, key):
        pass

    def init(self, **kwargs):
        pass

    def log(self, values, step):
        if step >= self.run.step:
            self.run.step = step
            self.kept.append((step, values))


def test_a_restarts_events_reach_wandb_though_they_name_an_earlier_rollout(monkeypatch):
    """The failed attempt logged up to rollout 5; the restarted session's `restart` (and `healed`) events name
    rollout 3, the one it resumes at. wandb keeps them at its current step, with their rollout id."""
    wandb = _StepKeepingWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setattr(metrics_logger, "public_config", lambda args: {})
    args = types.SimpleNamespace(wandb_key=None, wandb_project="p", wandb_group="g")
    first = metrics_logger._wandb_sink(args)
    for rollout_id in range(6):
        first({"event": "train", "rollout_id": rollout_id, "train/loss": 0.5})
    restarted = metrics_logger._wandb_sink(args)  # the restarted session opens its sinks again
    restarted({"event": "restart", "rollout_id": 3, "run/restarts": 1, "run/restart_checkpoint": 2})
    restarted({"event": "healed", "rollout_id": 3, "run/heal_s": 12.5, "run/engines_kept": 1})
    kept = {key: (step, values["rollout_id"]) for step, values in wandb.kept
            for key in values if key.startswith("run/")}
    assert kept == {"run/restarts": (5, 3), "run/restart_checkpoint": (5, 3), "run/heal_s": (5, 3),
                    "run/engines_kept": (5, 3)}
