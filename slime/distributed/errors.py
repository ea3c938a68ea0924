"""Errors raised when ranks of a training step stop agreeing or stop progressing.

All derive from DistributedStepError so the actor can catch one type and fail the step loudly.
"""
from __future__ import annotations


class DistributedStepError(RuntimeError):
    """A rank-consistency or liveness failure inside a fenced step."""


class CollectiveDivergenceError(DistributedStepError):
    """Ranks reached the same fence with different plans, metric keys or sequence numbers."""

    def __init__(self, message: str, *, phase: str, ranks: tuple[int, ...], fields: tuple[str, ...]):
        super().__init__(message)
        self.phase = phase
        self.ranks = ranks
        self.fields = fields


class FenceTimeoutError(DistributedStepError):
    """A fence or a deadline-bounded collective did not complete in time (or a peer failed)."""

    def __init__(self, message: str, *, phase: str, lagging_ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.phase = phase
        self.lagging_ranks = lagging_ranks


class WarmupTimeoutError(FenceTimeoutError):
    """One eager communicator warm-up op did not complete within its deadline."""


class HangError(DistributedStepError):
    """Raised in the stuck thread by the watchdog when a phase exceeds its deadline."""


class HubUnreachableError(DistributedStepError):
    """The progress hub (slime/distributed/progress_hub.py) did not answer for a whole no-progress window:
    the peers' progress is unknown, so no deadline can be kept honestly."""

    def __init__(self, message: str, *, hub: str = "", rank: int | None = None):
        super().__init__(message)
        self.hub = hub
        self.rank = rank
