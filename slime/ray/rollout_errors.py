"""Errors that end a rollout (or an eval): each names the engines and the requests concerned.

`str(error)` is one line (what `training stopped:` prints); `details` is the table behind it.
They cross from the rollout manager to the driver through Ray, which keeps their type.
"""
from __future__ import annotations


class RolloutError(RuntimeError):
    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details

    def __reduce__(self):  # Ray pickles errors: keep both fields
        return type(self), (str(self), self.details)


class RolloutTimeoutError(RolloutError, TimeoutError):
    """A rollout or eval did not finish within --rollout-timeout."""


class RolloutStepTimeoutError(RolloutError, TimeoutError):
    """A step of the rollout manager outside the generation itself (a user hook, the data save, the
    metrics) did not return within its window."""


class EngineFailedError(RolloutError):
    """An engine died or stopped answering and --use-fault-tolerance is off."""


class EngineRecoveryError(RolloutError):
    """A failed engine could not be restarted, or did not reach the trainer's weights."""
