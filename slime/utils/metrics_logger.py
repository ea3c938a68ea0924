"""Driver-side metrics sinks: stdout, `--metrics-jsonl`, wandb, TensorBoard.

Ranks never log to external services: they return reduced metrics to the driver, which
hands them to a background thread. A slow or stuck sink cannot hold a training rank
(upstream cause 2: rank-0-only blocking logging), and `close()` has a deadline.
"""
from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
from typing import Any

from slime.utils.security import public_config

logger = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, args):
        self._sinks = _open_sinks(args)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._drain, name="metrics-logger", daemon=True)
        self._thread.start()

    def log(self, kind: str, step: int, metrics: dict[str, Any]) -> None:
        """Queue one event; returns at once."""
        event = {"event": kind, "rollout_id": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        self._queue.put(event)

    def close(self, timeout_s: float = 60.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("metrics sinks did not finish within %.0fs; some events may be lost", timeout_s)

    def _drain(self) -> None:
        while (event := self._queue.get()) is not None:
            for sink in self._sinks:
                try:
                    sink(event)
                except Exception:  # a broken sink must not stop training
                    logger.exception("metrics sink %s failed", getattr(sink, "__name__", sink))


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _open_sinks(args) -> list:
    sinks = [_stdout_sink]
    if getattr(args, "metrics_jsonl", None):
        sinks.append(_jsonl_sink(args.metrics_jsonl))
    if getattr(args, "use_wandb", False):
        sinks.append(_wandb_sink(args))
    if getattr(args, "use_tensorboard", False) or getattr(args, "tensorboard_dir", None):
        sinks.append(_tensorboard_sink(args))
    return sinks


def _stdout_sink(event: dict) -> None:
    shown = {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in event.items()
             if k not in ("event", "rollout_id")}
    print(f"[{event['event']} {event['rollout_id']}] " + " ".join(f"{k}={v}" for k, v in shown.items()),
          flush=True)


def _jsonl_sink(path: str):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    handle = open(path, "a", buffering=1)

    def write_jsonl(event: dict) -> None:
        handle.write(json.dumps(event) + "\n")

    return write_jsonl


def _wandb_sink(args):
    try:
        import wandb
    except ImportError as exc:
        raise SystemExit("--use-wandb needs the wandb package: pip install wandb") from exc
    if getattr(args, "wandb_key", None):
        wandb.login(key=args.wandb_key)
    wandb.init(project=args.wandb_project, group=getattr(args, "wandb_group", None), config=public_config(args))

    def write_wandb(event: dict) -> None:
        wandb.log({k: v for k, v in event.items() if isinstance(v, (int, float))}, step=event["rollout_id"])

    return write_wandb


def tensorboard_log_dir(args) -> str:
    """$TENSORBOARD_DIR (upstream's override), else --tensorboard-dir (or --tb-project-name), else
    tensorboard_log; --tb-experiment-name adds a sub-directory per run."""
    if os.environ.get("TENSORBOARD_DIR"):
        return os.environ["TENSORBOARD_DIR"]
    base = getattr(args, "tensorboard_dir", None) or "tensorboard_log"
    experiment = getattr(args, "tb_experiment_name", None)
    return os.path.join(base, experiment) if experiment else base


def _tensorboard_sink(args):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise SystemExit("TensorBoard logging needs the tensorboard package: pip install tensorboard") from exc
    log_dir = tensorboard_log_dir(args)
    logger.info("TensorBoard logs in %s", log_dir)
    writer = SummaryWriter(log_dir=log_dir)

    def write_tensorboard(event: dict) -> None:
        for key, value in event.items():
            if isinstance(value, (int, float)) and key != "rollout_id":
                writer.add_scalar(key, value, event["rollout_id"])
        writer.flush()

    return write_tensorboard
