"""Waiting on Ray with a deadline that follows the ranks' progress: the driver never blocks forever.

A phase fails when no rank made progress for `window_s` (as the progress hub sees every node's
ranks: the same rule as on the ranks, slime/utils/deadlines.py), however long it has been running; so the limit
grows with the number of steps of a rollout and with the size of a checkpoint. A rank that raised
surfaces at once (not after the others finish). Each error has a one-line message (`str()`) for
the final "training stopped:" line, and `details` for the lines above it: the first failing
rank's traceback and one table of every rank, rendered by the progress hub.
"""
from __future__ import annotations

import re
import time
from typing import Callable, Sequence

import ray

from slime.utils.deadlines import OTHER_RANK_FAILURES_S


class RankWaitError(RuntimeError):
    """A phase ended without every rank's result."""

    def __init__(self, summary: str, *, phase: str, ranks: Sequence[int], details: str = "",
                 blamed: Sequence[int] = (), role: str = "actor"):
        super().__init__(summary)
        self.phase = phase
        self.ranks = tuple(ranks)
        self.details = details
        self.blamed = tuple(blamed) or self.ranks
        """The ranks at fault: those a failing rank's fence found lagging, else `ranks`."""
        self.role = role
        """Whose ranks these are ("actor" or "critic": each role numbers its ranks from 0)."""


class RankDeadlineError(RankWaitError):
    """No rank made progress for the phase's window while some had not finished."""


class RankFailedError(RankWaitError):
    """A rank raised (or its process ended) during a phase; the others are no longer waited for."""


def wait_ranks(refs: Sequence[ray.ObjectRef], *, phase: str, window_s: float,
               progress: Callable[[], float] | None = None,
               describe_hang: Callable[[], str] | None = None,
               describe_exit: Callable[[], str] | None = None,
               poll_s: float = 5.0, on_poll: Callable[[], None] | None = None, role: str = "actor") -> list:
    """Results of `refs` (one per rank) in rank order, or a named error.

    `progress()` is the latest time (wall clock) any rank made progress; without it the window runs
    from the call. `describe_hang` renders where every rank is; `describe_exit` says why a rank
    process ended (a watchdog leaves its verdict in a file before exiting). `on_poll` runs between
    waits (at least every second): what runs beside the phase (a rollout) is watched, and may raise.
    `role`: whose ranks the refs are (named on the error).
    """
    if on_poll is not None:
        poll_s = min(poll_s, 1.0)
    index = {ref: rank for rank, ref in enumerate(refs)}
    pending = list(refs)
    start = time.time()
    while pending:
        idle = time.time() - max(start, progress() if progress else start)
        if idle > window_s:
            missing = sorted(index[r] for r in pending)
            settle_unwatched(pending)
            raise RankDeadlineError(
                f"phase '{phase}': no rank made progress for {idle:.0f}s; ranks {missing} did not finish",
                phase=phase, ranks=missing, details=_table(describe_hang), role=role)
        if on_poll is not None:
            on_poll()
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.1, min(poll_s, window_s - idle)))
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:  # the first failing rank names the problem
                others, exited = _other_failures([r for r in refs if r is not ref], index)
                failure = _failure(phase, index[ref], exc, others, describe_hang, describe_exit)
                failure.role = role
                if exited and not isinstance(exc, ray.exceptions.RayActorError):  # those that lost a peer: not at fault
                    failure.blamed = tuple(exited)
                settle_unwatched(refs)
                raise failure from exc
    return ray.get(list(refs))


def settle_unwatched(refs: Sequence[ray.ObjectRef]) -> None:
    """The driver stops waiting for these calls (a failure is being reported): each result is taken when it arrives,
    so that Ray does not print a rank's later error, one the report already covers, as an "Unhandled error"
    after the run's last line."""
    for ref in refs:
        ref.future()  # a future fetches the result, and so marks it as seen, however it ends


def _table(describe_hang: Callable[[], str] | None) -> str:
    return f"where every rank is:\n{describe_hang()}" if describe_hang else ""


def _other_failures(refs: list, index: dict, grace_s: float = OTHER_RANK_FAILURES_S) -> tuple[list[str], list[int]]:
    """One line per other rank that failed too (ranks that meet at a fence fail together), and the ranks whose
    process ended. Getting them also keeps Ray from printing each one as an unhandled error."""
    if not refs:
        return [], []
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
    alike: dict[str, list[tuple[int, str]]] = {}  # messages that differ only in the reporting rank
    exited = []
    for ref in done:
        try:
            ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - reported, not raised: the first failure is
            if isinstance(exc, ray.exceptions.RayActorError):
                exited.append(index[ref])
            message = _cause(exc)[0].partition("\n")[0][:200]
            alike.setdefault(re.sub(r"\brank \d+\b", "rank N", message), []).append((index[ref], message))
    groups = sorted(sorted(group) for group in alike.values())
    return [f"ranks {[rank for rank, _ in group]}: {group[0][1]}" for group in groups], sorted(exited)


def _failure(phase: str, rank: int, exc: Exception, others: list[str], describe_hang, describe_exit
             ) -> RankFailedError:
    also = "also failed:\n" + "\n".join(others) if others else ""
    if isinstance(exc, ray.exceptions.RayActorError):  # the rank's process is gone
        verdict = describe_exit() if describe_exit else ""
        return RankFailedError(f"phase '{phase}': rank {rank} exited: {verdict}", phase=phase, ranks=(rank,),
                               details=_join(also, _table(describe_hang)))
    message, traceback_text, stalled = _cause(exc)
    first, _, rest = message.partition("\n")
    own = f"rank {rank} traceback:\n{traceback_text.rstrip()}" if traceback_text else rest
    return RankFailedError(f"phase '{phase}' failed on rank {rank}: {first}", phase=phase, ranks=(rank,),
                           details=_join(own, also, _table(describe_hang) if stalled else ""),
                           blamed=_lagging(exc))


def _join(*parts: str) -> str:
    return "\n".join(part for part in parts if part)


def _lagging(exc: BaseException) -> tuple[int, ...]:
    """The peers the failing rank's fence found lagging (a rank's error carries them: RankError)."""
    cause = getattr(exc, "cause", None) or exc.__cause__
    return tuple(getattr(cause, "lagging", ()) or ())


def _cause(exc: BaseException) -> tuple[str, str, bool]:
    """(message, rank traceback, is a stall) of a Ray task error; Ray wraps the rank's exception."""
    cause = getattr(exc, "cause", None) or exc.__cause__
    if cause is None:
        return str(exc), "", True
    if type(cause).__name__ == "RankError":
        return str(cause), getattr(cause, "traceback_text", ""), getattr(cause, "stalled", True)
    return f"{type(cause).__name__}: {cause}", "", True
