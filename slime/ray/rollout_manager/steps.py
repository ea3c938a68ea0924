"""The rollout manager's work around the guarded generation, each step under its own window.

`RolloutManager.generate` and `evaluate` do more than the rollout function that `RolloutGuard` bounds:
before it they load the function and count the eval prompts; after it they dump the rollout
(--save-debug-rollout-data), save the data position, convert the samples, call the log hooks and
compute the metrics. Each such step runs in a worker thread and must return within `window_s`
(slime/utils/deadlines.py: rollout_step_window_s), or RolloutStepTimeoutError names the step and the flag
behind it. `left_s()` is what the manager's status reports while no guarded rollout runs, so the
driver's wait (slime/ray/driver/rollout_wait.py) has a deadline from the call's first line to its last.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from slime.ray.rollout_manager.errors import RolloutStepTimeoutError
from slime.ray.rollout_manager.guard import RolloutWorker
from slime.utils.deadlines import RolloutClock


class RolloutSteps:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.clock = RolloutClock()

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """One manager call (generate or evaluate): its clock runs from here to the end."""
        self.clock.start(self.window_s)
        try:
            yield
        finally:
            self.clock.stop()

    def run(self, label: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) within one window (the clock restarts: each step has its own)."""
        self.clock.start(self.window_s)
        worker = RolloutWorker(lambda: fn(*args))
        if not worker.done.wait(self.window_s):
            raise RolloutStepTimeoutError(f"{label} did not return within {self.window_s:.0f}s (--fence-timeout)")
        self.clock.start(self.window_s)  # the guarded rollout or the next step follows
        if worker.error is not None:
            raise worker.error
        return worker.result

    def guarded(self, fn: Callable[[], Any]) -> Any:
        """The guarded rollout: RolloutGuard's own clock bounds it, this one waits."""
        self.clock.stop()
        try:
            return fn()
        finally:
            self.clock.start(self.window_s)

    def left_s(self) -> float | None:
        return self.clock.left_s()
