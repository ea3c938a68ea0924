"""Errors that end a rollout (or an eval): each names the engines and the requests concerned.

`str(error)` is one line (what `training stopped:` prints); `details` is the table behind it.
They cross from the rollout manager to the driver through Ray, which keeps their type.
"""
from __future__ import annotations

import functools
import traceback


class RolloutError(RuntimeError):
    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details

    def __reduce__(self):  # Ray pickles errors: keep both fields
        return type(self), (str(self), self.details)


class RolloutTimeoutError(RolloutError, TimeoutError):
    """A rollout or eval did not finish within --rollout-timeout."""


class EngineStalledError(RolloutTimeoutError):
    """An engine held requests without progress for --rollout-no-progress-timeout (--use-fault-tolerance off)."""


class RolloutStepTimeoutError(RolloutError, TimeoutError):
    """A step of the rollout manager outside the generation itself (a user hook, the data save, the
    metrics) did not return within its window."""


class EngineFailedError(RolloutError):
    """An engine died or stopped answering and --use-fault-tolerance is off."""


class EngineRecoveryError(RolloutError):
    """A failed engine could not be restarted, or did not reach the trainer's weights."""


class RolloutFailedError(RolloutError):
    """Anything else a rollout or eval raised (a plug-in's error, an engine's HTTP 500), as "Type: message" and
    its traceback: Ray cannot carry every exception to the driver (one holding an HTTP session, one of a class
    the driver never imported arrives as "Failed to deserialize exception")."""


def portable_rollout_errors(method):
    """A rollout manager call `method(self, rollout_id, ...)` that raises RolloutErrors only, each of which
    crosses Ray intact."""

    @functools.wraps(method)
    def call(self, rollout_id: int, *args, **kwargs):
        try:
            return method(self, rollout_id, *args, **kwargs)
        except RolloutError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised as a portable error with the traceback
            raise RolloutFailedError(f"{method.__name__} of rollout {rollout_id}: {type(exc).__name__}: {exc}",
                                     traceback.format_exc()) from None

    return call
