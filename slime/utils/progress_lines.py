"""What a run prints on stdout: pure functions from metrics events to short lines (the start line: slime/ray/driver/session.py).

By default a run prints what it is starting, one short line per slow start-up step, and then one line per
rollout once the rollout's events are in:

    rollout 3/20  reward 0.41  loss 0.012  diff 2.1e-05  sync 0.10s  step 2.3s  left ~1m20s

(rollout id / --num-rollout, mean reward, train/loss, train/train_rollout_logprob_abs_diff, weight-sync
seconds, actor_train seconds, the time left at the pace of the last rollouts). Eval results get a line of
their own. `--verbose` prints every event as `[kind k] key=value ...` instead. Memory figures are shown
only where some are non-zero (on GPUs); every number still goes to `--metrics-jsonl`, wandb and TensorBoard.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The events one rollout's line is made of; any other kind is printed as its own event line.
ROLLOUT_KINDS = ("rollout", "train", "weight_sync", "memory")
PACE_WINDOW = 5
"""Rollouts whose mean wall time estimates the time left."""


def event_line(event: Mapping[str, Any]) -> str:
    """One event as `[kind k] key=value ...` (every key; floats to 6 significant digits)."""
    shown = {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in event.items()
             if k not in ("event", "rollout_id")}
    return f"[{event['event']} {event['rollout_id']}] " + " ".join(f"{k}={v}" for k, v in shown.items())


DEVICE_MEMORY_KEYS = ("allocated_gb", "reserved_gb", "process_gb", "context_and_comm_gb")
"""Endings of the device-memory figures (peak_reserved_gb included): all 0 without a GPU. The bytes a sleeping
trainer copied to the host and the seconds it took are not device figures."""


def has_memory_figures(event: Mapping[str, Any]) -> bool:
    """Whether a memory event holds a non-zero device-memory figure (on CPU they are all 0)."""
    return any(isinstance(v, (int, float)) and v != 0 for k, v in event.items()
               if k.startswith("memory/") and k.endswith(DEVICE_MEMORY_KEYS))


def peak_memory_gb(event: Mapping[str, Any] | None) -> float:
    """The highest peak of reserved device memory any engine or trainer rank reported (0 on CPU)."""
    if not event:
        return 0.0
    return max((float(v) for k, v in event.items() if k.endswith("peak_reserved_gb") and isinstance(v, (int, float))),
               default=0.0)


def duration(seconds: float) -> str:
    """'0.4s', '45s', '1m20s', '2h03m'."""
    if seconds < 9.95:
        return f"{max(0.0, seconds):.1f}s"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def count(n: int, noun: str) -> str:
    """'1 engine', '8 engines'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _number(value: Any, fmt: str) -> str | None:
    if value in ("nan", "inf", "-inf"):  # how the events carry a non-finite figure: shown, never dropped
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return format(value, fmt)


def rollout_line(rollout_id: int, num_rollout: int | None, events: Mapping[str, Mapping[str, Any]],
                 seconds_left: float | None = None, elapsed_s: float | None = None) -> str:
    """The one line of a finished rollout from its events by kind ('rollout', 'train', 'weight_sync',
    'memory'); a figure whose event or key is missing is left out. `seconds_left`: the estimate shown as
    `left ~...`; `elapsed_s` (the last rollout): the run's time, shown as `done in ...`."""
    rollout, train = events.get("rollout", {}), events.get("train", {})
    sync = events.get("weight_sync", {})
    parts = [f"rollout {rollout_id}/{num_rollout}" if num_rollout else f"rollout {rollout_id}"]
    for label, value, fmt in (("reward", rollout.get("rollout/raw_reward"), ".3g"),
                              ("loss", train.get("train/loss"), ".3g"),
                              ("diff", train.get("train/train_rollout_logprob_abs_diff"), ".2g"),
                              ("sync", sync.get("weight_sync/seconds"), ".2f"),
                              ("step", train.get("perf/actor_train_s"), ".1f")):
        text = _number(value, fmt)
        if text is not None:
            parts.append(f"{label} {text}{'s' if label in ('sync', 'step') else ''}")
    peak = peak_memory_gb(events.get("memory"))
    if peak > 0:
        parts.append(f"mem {peak:.1f}G")
    if elapsed_s is not None:
        parts.append(f"done in {duration(elapsed_s)}")
    elif seconds_left is not None:
        parts.append(f"left ~{duration(seconds_left)}")
    return "  ".join(parts)


def eval_line(event: Mapping[str, Any]) -> str:
    """`eval k: name 0.41  other 0.7` (each dataset's mean reward, `eval/<name>`; k: the weights' version)."""
    scores = [(k[len("eval/"):], v) for k, v in event.items()
              if k.startswith("eval/") and "/" not in k[len("eval/"):] and isinstance(v, (int, float))]
    shown = "  ".join(f"{name} {value:.3g}" for name, value in scores) or "no scores"
    return f"eval {event['rollout_id']}: {shown}"


def placement_summary(event: Mapping[str, Any]) -> str:
    """The placement record in one line: how many ranks and engines on how many nodes, and which."""
    ranks = list(event.get("placement/ranks") or [])
    engines = list(event.get("placement/engines") or [])
    nodes = sorted({str(x.get("node_ip")) for x in [*ranks, *engines] if x.get("node_ip")})
    gpus = sum(len(r.get("gpu_ids") or ()) for r in ranks)
    where = f"{count(len(nodes), 'node')} ({', '.join(nodes[:4])}{', ...' if len(nodes) > 4 else ''})"
    text = f"placement: {count(len(ranks), 'trainer rank')}, {count(len(engines), 'engine')} on {where}"
    if gpus:
        text += f", {count(gpus, 'trainer GPU')}"
    urls = [str(e["url"]) for e in engines if e.get("url")]
    if urls:
        text += f"; engines at {', '.join(urls[:2])}{', ...' if len(urls) > 2 else ''}"
    return text


class RolloutProgress:
    """Collects each rollout's events until the loop says the rollout is done, then makes its line.

    Times are given by the caller (monotonic seconds), so the estimate is testable: a rollout's wall
    time runs from the previous mark (the last start-up step's end, or the previous rollout's end)."""

    def __init__(self, started: float) -> None:
        self._started = started
        """When the run started: the last rollout's line says how long the whole run took."""
        self._events: dict[int, dict[str, dict]] = {}
        self._durations: list[float] = []
        self._mark: float | None = None

    def mark(self, now: float) -> None:
        """Start-up work ended at `now`: the next rollout's time counts from here."""
        self._mark = now

    def add(self, event: Mapping[str, Any]) -> None:
        self._events.setdefault(event["rollout_id"], {})[event["event"]] = dict(event)

    def done(self, rollout_id: int, num_rollout: int | None, now: float) -> str:
        if self._mark is not None:
            self._durations.append(now - self._mark)
        self._mark = now
        events = self._events.pop(rollout_id, {})
        for stale in [k for k in self._events if k < rollout_id]:  # events of rollouts that logged no end
            self._events.pop(stale)
        if num_rollout and rollout_id + 1 >= num_rollout:
            return rollout_line(rollout_id, num_rollout, events, elapsed_s=now - self._started)
        left = None
        if num_rollout and self._durations:
            recent = self._durations[-PACE_WINDOW:]
            left = sum(recent) / len(recent) * (num_rollout - rollout_id - 1)
        return rollout_line(rollout_id, num_rollout, events, seconds_left=left)
