"""Driver-side metrics sinks: stdout, `--metrics-jsonl`, wandb, TensorBoard.

Ranks never log to external services: they return reduced metrics to the driver, which
hands them to a background thread. A slow or stuck sink cannot hold a training rank
(upstream cause 2: rank-0-only blocking logging), and `close()` has a deadline.

Every event reaches every sink unchanged; stdout shows them as the run's progress lines
(slime/utils/progress_lines.py: one line per rollout, or every event with --verbose).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import threading
import time
from typing import Any

from slime.utils import progress_lines
from slime.utils.deadlines import METRICS_CLOSE_S, WANDB_INIT_S
from slime.utils.security import public_config

logger = logging.getLogger(__name__)

RUN_EVENTS = ("restart", "healed")
"""Events of the run rather than of a rollout (--max-restarts): every sink must keep them."""


class MetricsLogger:
    def __init__(self, args, console: Console | None = None):
        self.console = console or Console(args)
        self._sinks = [self.console.event, *_open_sinks(args)]
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._drain, name="metrics-logger", daemon=True)
        self._thread.start()
        self.console.queue_to(self._queue)  # its own lines keep their place among the events from now on

    def log(self, kind: str, step: int, metrics: dict[str, Any]) -> None:
        """Queue one event; returns at once."""
        event = {"event": kind, "rollout_id": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        self._queue.put(event)

    def rollout_done(self, rollout_id: int) -> None:
        """Every event of the rollout is logged: stdout gets its line (no other sink sees this)."""
        self._queue.put(_ConsoleCall(self.console.rollout_done, (rollout_id, time.monotonic())))

    def close(self, timeout_s: float = METRICS_CLOSE_S) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("metrics sinks did not finish within %.0fs; some events may be lost", timeout_s)

    def _drain(self) -> None:
        while (event := self._queue.get()) is not None:
            if isinstance(event, _ConsoleCall):
                event.run()
                continue
            for sink in self._sinks:
                try:
                    sink(event)
                except Exception:  # a broken sink must not stop training
                    logger.exception("metrics sink %s failed", getattr(sink, "__name__", sink))


class _ConsoleCall:
    """A stdout-only item of the queue: a line or a rollout's end, in order with the events."""

    def __init__(self, call, call_args: tuple) -> None:
        self.call, self.call_args = call, call_args

    def run(self) -> None:
        try:
            self.call(*self.call_args)
        except Exception:  # a broken line must not stop training
            logger.exception("progress line failed")


class Console:
    """The run's stdout: the start line and start-up steps, then one line per rollout (every event with
    --verbose). Before a MetricsLogger drains it, lines are printed at once; after, they go through the
    logger's queue, so that they keep their place among the events."""

    def __init__(self, args, *, out=None) -> None:
        self.args = args
        self.verbose = bool(args.verbose)
        self._print = out or (lambda line: print(line, flush=True))
        self._queue: queue.Queue | None = None
        self.progress = progress_lines.RolloutProgress(started=time.monotonic())

    def queue_to(self, events: queue.Queue) -> None:
        self._queue = events

    def say(self, line: str) -> None:
        """Print `line` (in order with the queued events)."""
        self._in_order(self._print, line)

    def rollouts_begin(self) -> None:
        """Start-up is over: the first rollout's time counts from now."""
        self._in_order(self.progress.mark, time.monotonic())

    def _in_order(self, call, *call_args) -> None:
        if self._queue is None:
            call(*call_args)
        else:
            self._queue.put(_ConsoleCall(call, call_args))

    @contextlib.contextmanager
    def step(self, begins: str, ends: str):
        """A slow start-up step: `begins ...` now, `ends (Ns)` when it is over."""
        self.say(f"{begins} ...")
        start = time.monotonic()
        yield
        self.say(f"{ends} ({progress_lines.duration(time.monotonic() - start)})")

    def event(self, event: dict) -> None:
        """One metrics event (the drain thread): printed whole with --verbose; else kept for the rollout's
        line, an eval or placement as a short line of its own, and any other kind whole."""
        kind = event["event"]
        if self.verbose:
            if kind != "memory" or progress_lines.has_memory_figures(event):  # all zero on CPU: not shown
                self._print(progress_lines.event_line(event))
        elif kind == "eval":
            self._print(progress_lines.eval_line(event))
        elif kind == "placement":
            self._print(progress_lines.placement_summary(event))
        elif kind not in progress_lines.ROLLOUT_KINDS:
            self._print(progress_lines.event_line(event))
        elif event["rollout_id"] >= self.args.start_rollout_id:  # resolved (from --load) before the logger starts
            self.progress.add(event)
        elif kind == "memory" and progress_lines.has_memory_figures(event):  # start-up (the steps have lines)
            self._print(f"memory {event['rollout_id']}: peak {progress_lines.peak_memory_gb(event):.1f}G")

    def rollout_done(self, rollout_id: int, now: float) -> None:
        line = self.progress.done(rollout_id, self.args.num_rollout, now)
        if not self.verbose:
            self._print(line)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _open_sinks(args) -> list:
    sinks = []
    if args.metrics_jsonl:
        sinks.append(_jsonl_sink(args.metrics_jsonl, run_event(args)))
    if args.use_wandb:
        sinks.append(_wandb_sink(args))
    if args.use_tensorboard or args.tensorboard_dir:
        sinks.append(_tensorboard_sink(args))
    return sinks


def within_deadline(fn, timeout_s: float, what: str, fix: str) -> None:
    """fn() in a daemon thread; its error re-raised here, or SystemExit naming `what` and `fix` at the deadline."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(exc)

    worker = threading.Thread(target=run, name="deadline-call", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        raise SystemExit(f"{what} did not return within {timeout_s:.0f}s: {fix}")
    if outcome[0] is not None:
        raise outcome[0]


RUN_EVENT = "run"
"""The first line a run writes to --metrics-jsonl (a resumed run writes its own): facts readers of the file need,
such as the training dtype slime/tools/plot_metrics.py draws its agreement line from."""


def run_event(args) -> dict:
    return {"event": RUN_EVENT, "rollout_id": args.start_rollout_id, "run/dtype": "bf16" if args.bf16 else "fp32"}


def _jsonl_sink(path: str, first: dict):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    handle = open(path, "a", buffering=1)
    handle.write(json.dumps(first) + "\n")

    def write_jsonl(event: dict) -> None:
        handle.write(json.dumps(event) + "\n")

    return write_jsonl


def _wandb_sink(args):
    try:
        import wandb
    except ImportError as exc:
        raise SystemExit("--use-wandb needs the wandb package: pip install wandb") from exc
    def start() -> None:
        if args.wandb_key:
            wandb.login(key=args.wandb_key)
        wandb.init(project=args.wandb_project, group=args.wandb_group, config=public_config(args))

    within_deadline(start, WANDB_INIT_S, "--use-wandb: wandb.init (login and run creation)",
                    "check the network to the wandb server, or run with WANDB_MODE=offline")

    def write_wandb(event: dict) -> None:
        step = event["rollout_id"]
        if event["event"] in RUN_EVENTS and wandb.run is not None:
            # a restart's events name a rollout below the failed attempt's last step, and wandb drops a step
            # below its last: they go to that step, with their rollout id as a value
            step = max(step, wandb.run.step)
        wandb.log({k: v for k, v in event.items() if isinstance(v, (int, float))}, step=step)

    return write_wandb


def tensorboard_log_dir(args) -> str:
    """$TENSORBOARD_DIR (upstream's override), else --tensorboard-dir (or --tb-project-name, else tensorboard_log:
    slime/config/defaults.py completes it); --tb-experiment-name adds a sub-directory per run."""
    if os.environ.get("TENSORBOARD_DIR"):
        return os.environ["TENSORBOARD_DIR"]
    base = args.tensorboard_dir
    experiment = args.tb_experiment_name
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
