"""Waiting on Ray with a deadline that follows the ranks' progress: the driver never blocks forever.

A phase fails when no rank made progress for `window_s` (read from their ledger files: the same
rule as on the ranks, slime/utils/deadlines.py), however long it has been running; so the limit
grows with the number of steps of a rollout and with the size of a checkpoint. A rank that raised
surfaces at once (not after the others finish). Each error has a one-line message (`str()`) for
the final "training stopped:" line, and `details` for the lines above it: the first failing
rank's traceback and one table of every rank, rendered here from the ledger files.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import ray


class RankWaitError(RuntimeError):
    """A phase ended without every rank's result."""

    def __init__(self, summary: str, *, phase: str, ranks: Sequence[int], details: str = ""):
        super().__init__(summary)
        self.phase = phase
        self.ranks = tuple(ranks)
        self.details = details


class RankDeadlineError(RankWaitError):
    """No rank made progress for the phase's window while some had not finished."""


class RankFailedError(RankWaitError):
    """A rank raised (or its process ended) during a phase; the others are no longer waited for."""


def wait_ranks(refs: Sequence[ray.ObjectRef], *, phase: str, window_s: float,
               progress: Callable[[], float] | None = None,
               describe_hang: Callable[[], str] | None = None,
               describe_exit: Callable[[], str] | None = None,
               poll_s: float = 5.0) -> list:
    """Results of `refs` (one per rank) in rank order, or a named error.

    `progress()` is the latest time (wall clock) any rank made progress; without it the window runs
    from the call. `describe_hang` renders where every rank is; `describe_exit` says why a rank
    process ended (a watchdog leaves its verdict in a file before exiting).
    """
    index = {ref: rank for rank, ref in enumerate(refs)}
    pending = list(refs)
    start = time.time()
    while pending:
        idle = time.time() - max(start, progress() if progress else start)
        if idle > window_s:
            missing = sorted(index[r] for r in pending)
            raise RankDeadlineError(
                f"phase '{phase}': no rank made progress for {idle:.0f}s; ranks {missing} did not finish",
                phase=phase, ranks=missing, details=describe_hang() if describe_hang else "")
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.1, min(poll_s, window_s - idle)))
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:  # the first failing rank names the problem
                raise _failure(phase, index[ref], exc, describe_hang, describe_exit) from exc
    return ray.get(list(refs))


def _failure(phase: str, rank: int, exc: Exception, describe_hang, describe_exit) -> RankFailedError:
    table = describe_hang() if describe_hang else ""
    if isinstance(exc, ray.exceptions.RayActorError):  # the rank's process is gone
        verdict = describe_exit() if describe_exit else ""
        return RankFailedError(f"phase '{phase}': rank {rank} exited: {verdict}", phase=phase, ranks=(rank,),
                               details=table)
    message, traceback_text = _cause(exc)
    first, _, rest = message.partition("\n")
    details = f"rank {rank} traceback:\n{traceback_text.rstrip()}" if traceback_text else rest
    return RankFailedError(f"phase '{phase}' failed on rank {rank}: {first}", phase=phase, ranks=(rank,),
                           details="\n".join(part for part in (details, table) if part))


def _cause(exc: BaseException) -> tuple[str, str]:
    """(message, rank traceback) of a Ray task error; Ray wraps the rank's exception."""
    cause = getattr(exc, "cause", None) or exc.__cause__
    if cause is None:
        return str(exc), ""
    if type(cause).__name__ == "RankError":
        return str(cause), getattr(cause, "traceback_text", "")
    return f"{type(cause).__name__}: {cause}", ""
