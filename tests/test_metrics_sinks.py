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
