"""The driver's side of a rollout: waiting on the rollout manager with a deadline, and bringing
engines restarted during a rollout to the trainer's weights.

While the manager generates, the driver polls its status every POLL_S (a call that must itself answer
within ROLLOUT_STATUS_CALL_S). The deadline is the manager's own (--rollout-timeout, extended by the
time its engines spent recovering) plus `rollout_driver_margin_s` (both: slime/utils/deadlines.py), so
the manager's report, which names engines and requests, always arrives first. Engines the manager restarted wait outside the router
until the trainer pushed its current weights to them (`EngineTargets.catch_up`), and the next
regular weight sync is aimed at the new set of engines.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from slime.ray.rollout_manager.errors import RolloutError
from slime.utils.deadlines import ROLLOUT_STATUS_CALL_S, unreported_deadline_s

logger = logging.getLogger(__name__)

POLL_S = 1.0


@dataclass
class EngineTargets:
    """What the trainer's weight sync is aimed at, as the driver knows it."""

    urls: tuple[str, ...] = ()
    """The engines the last push reached."""
    version: int | None = None
    """The weight version the engines hold (None before the first push: the checkpoint's)."""
    push: Callable[[list[str], int], dict[str, Any]] | None = None
    """(engine urls, version) -> metrics: the trainer pushes its current weights to these engines."""
    trainer_version: Callable[[], int] | None = None
    """The version of the trainer's weights now (None: the engines' version, as when the loop alternates;
    train_async.py's trainer runs ahead of the engines)."""
    catch_ups: list[dict[str, Any]] = field(default_factory=list)

    def for_sync(self, current: list[str]) -> list[str] | None:
        """The engine list a sync must be aimed at, or None when it is the one the trainer already has."""
        return None if tuple(current) == self.urls else list(current)

    def pushed(self, urls: list[str], version: int) -> None:
        self.urls, self.version = tuple(urls), version

    def catch_up(self, urls: list[str]) -> int | None:
        """Push the trainer's current weights to restarted engines; returns the version pushed, or None when
        there is nothing to push (no trainer, or nothing pushed yet: the checkpoint's weights are current)."""
        if self.push is None or self.version is None:
            return None
        version = self.trainer_version() if self.trainer_version is not None else self.version
        self.catch_ups.append(self.push(urls, version))
        self.urls = tuple(urls)  # the trainer now aims at these; the next sync re-aims at every engine
        return version


@dataclass
class ManagerDeadline:
    """The driver's limit on a manager call from the time left it reports: past the manager's deadline by
    margin_s, or reporting no deadline at all (the call not started, a step without its clock) for longer
    than unreported_deadline_s(margin_s)."""

    what: str
    margin_s: float
    unreported_since: float | None = None

    def check(self, left_s: float | None, now: float) -> str | None:
        """The error to raise for this report, or None."""
        if left_s is not None:
            self.unreported_since = None
            if left_s + self.margin_s < 0:
                return (f"rollout manager: '{self.what}' passed its deadline by {-left_s:.0f}s without "
                        f"reporting (driver margin {self.margin_s:.0f}s)")
            return None
        if self.unreported_since is None:
            self.unreported_since = now
        silent = now - self.unreported_since
        if silent > unreported_deadline_s(self.margin_s):
            return (f"rollout manager: '{self.what}' reported no deadline for {silent:.0f}s (the call never started "
                    f"its clock: the manager is busy elsewhere or stuck outside its steps)")
        return None


class RolloutWatch:
    """One manager call (generate or eval) in flight, watched without blocking the driver.

    Each `poll` waits at most its timeout for the call, then reads the manager's status: restarted engines
    are caught up (when the caller's trainer is free to push; else they wait for the next poll that may),
    and a manager that neither answers nor ends within its deadline + margin_s raises TimeoutError."""

    def __init__(self, actor, ref: ray.ObjectRef, *, what: str, margin_s: float, targets: EngineTargets) -> None:
        self.actor, self.ref, self.what = actor, ref, what
        self.margin_s = margin_s
        self.targets = targets
        self.waiting_for_weights: list[str] = []
        """Restarted engines seen by a poll that could not catch them up."""
        self.deadline = ManagerDeadline(what, margin_s)

    def poll(self, timeout_s: float = POLL_S, *, can_push: bool = True) -> bool:
        """True once the call has ended (its error, if any, raises here)."""
        done, _ = ray.wait([self.ref], timeout=timeout_s)
        if done:
            get_result(self.ref)  # a failed rollout raises now, not when its result is asked for
            return True
        status = get_result(self.actor.rollout_status.remote(), timeout_s=ROLLOUT_STATUS_CALL_S, what="rollout status")
        self.waiting_for_weights = list(status["needs_weights"])
        if self.waiting_for_weights and can_push:
            version = self.targets.catch_up(self.waiting_for_weights)
            get_result(self.actor.engines_caught_up.remote(self.waiting_for_weights,
                                                           None if version is None else str(version)),
                       timeout_s=ROLLOUT_STATUS_CALL_S, what="engines caught up")
            self.waiting_for_weights = []
        error = self.deadline.check(status["left_s"], time.monotonic())
        if error is not None:
            ray.cancel(self.ref, force=False)
            settle_unwatched([self.ref])  # its cancellation error is this timeout's
            raise TimeoutError(error)
        return False

    def result(self) -> Any:
        while not self.poll():
            pass
        return get_result(self.ref)


def wait_for_rollout(actor, ref: ray.ObjectRef, *, what: str, margin_s: float, targets: EngineTargets) -> Any:
    """The manager call's result; meanwhile restarted engines are caught up, and a manager that neither
    answers nor ends within its deadline + margin_s raises TimeoutError."""
    return RolloutWatch(actor, ref, what=what, margin_s=margin_s, targets=targets).result()


def get_result(ref: ray.ObjectRef, *, timeout_s: float | None = None, what: str = "call") -> Any:
    """ray.get that re-raises a RolloutError from the manager as itself (one clean line, its table kept)."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        raise TimeoutError(f"rollout manager: '{what}' did not answer within {timeout_s:.0f}s") from exc
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, RolloutError):
            raise type(cause)(str(cause), cause.details) from None
        raise
