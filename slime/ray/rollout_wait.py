"""The driver's side of a rollout: waiting on the rollout manager with a deadline, and bringing
engines restarted during a rollout to the trainer's weights.

While the manager generates, the driver polls its status every POLL_S (a call that must itself answer
within STATUS_TIMEOUT_S). The deadline is the manager's own (--rollout-timeout, extended by the
time its engines spent recovering) plus `driver_margin_s`, so the manager's report, which names
engines and requests, always arrives first. Engines the manager restarted wait outside the router
until the trainer pushed its current weights to them (`EngineTargets.catch_up`), and the next
regular weight sync is aimed at the new set of engines.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from slime.ray.rollout_errors import RolloutError

logger = logging.getLogger(__name__)

POLL_S = 1.0
STATUS_TIMEOUT_S = 60.0


@dataclass
class EngineTargets:
    """What the trainer's weight sync is aimed at, as the driver knows it."""

    urls: tuple[str, ...] = ()
    """The engines the last push reached."""
    version: int | None = None
    """The weight version the engines hold (None before the first push: the checkpoint's)."""
    push: Callable[[list[str], int], dict[str, Any]] | None = None
    """(engine urls, version) -> metrics: the trainer pushes its current weights to these engines."""
    catch_ups: list[dict[str, Any]] = field(default_factory=list)

    def for_sync(self, current: list[str]) -> list[str] | None:
        """The engine list a sync must be aimed at, or None when it is the one the trainer already has."""
        return None if tuple(current) == self.urls else list(current)

    def pushed(self, urls: list[str], version: int) -> None:
        self.urls, self.version = tuple(urls), version

    def catch_up(self, urls: list[str]) -> dict[str, Any] | None:
        """Push the current weights to restarted engines; None when there is nothing to push (no trainer,
        or nothing pushed yet: the checkpoint's weights are current)."""
        if self.push is None or self.version is None:
            return None
        metrics = self.push(urls, self.version)
        self.urls = tuple(urls)  # the trainer now aims at these; the next sync re-aims at every engine
        self.catch_ups.append(metrics)
        return metrics


def wait_for_rollout(actor, ref: ray.ObjectRef, *, what: str, margin_s: float, targets: EngineTargets) -> Any:
    """The manager call's result; meanwhile restarted engines are caught up, and a manager that neither
    answers nor ends within its deadline + margin_s raises TimeoutError."""
    while True:
        done, _ = ray.wait([ref], timeout=POLL_S)
        if done:
            return get_result(ref)
        status = get_result(actor.rollout_status.remote(), timeout_s=STATUS_TIMEOUT_S, what="rollout status")
        if status["needs_weights"]:
            metrics = targets.catch_up(status["needs_weights"])
            get_result(actor.engines_caught_up.remote(status["needs_weights"],
                                                      None if metrics is None else str(targets.version)),
                       timeout_s=STATUS_TIMEOUT_S, what="engines caught up")
        left = status["left_s"]
        if left is not None and left + margin_s < 0:
            ray.cancel(ref, force=False)
            raise TimeoutError(f"rollout manager: '{what}' passed its deadline by {-left:.0f}s without reporting "
                               f"(driver margin {margin_s:.0f}s)")


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
