"""Waiting on Ray with a deadline: the driver never blocks forever on its ranks.

A rank that raised surfaces at once (not after the others finish); a rank that never
answers turns into `RankDeadlineError` naming the phase and the ranks still out.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import ray


class RankDeadlineError(RuntimeError):
    """Some ranks did not finish a phase within its deadline."""


class RankFailedError(RuntimeError):
    """A rank raised during a phase; the others are no longer waited for."""


def wait_ranks(refs: Sequence[ray.ObjectRef], *, phase: str, timeout_s: float,
               describe_hang: Callable[[], str] | None = None,
               describe_exit: Callable[[], str] | None = None) -> list:
    """Results of `refs` (one per rank) in rank order, or a named error within `timeout_s`.

    `describe_hang` renders where every rank is (on a deadline); `describe_exit` says why a rank
    process ended (a watchdog leaves its verdict in a file before exiting).
    """
    index = {ref: rank for rank, ref in enumerate(refs)}
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(index[r] for r in pending)
            report = describe_hang() if describe_hang else ""
            raise RankDeadlineError(
                f"phase '{phase}' did not finish within {timeout_s:.0f}s on ranks {missing}"
                + (f"\n{report}" if report else ""))
        done, pending = ray.wait(pending, num_returns=1, timeout=min(left, 5.0))
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:  # the first failing rank names the problem
                if isinstance(exc, ray.exceptions.RayActorError):  # the rank's process is gone
                    verdict = describe_exit() if describe_exit else ""
                    raise RankFailedError(f"phase '{phase}': rank {index[ref]} exited: {verdict}") from exc
                raise RankFailedError(
                    f"phase '{phase}' failed on rank {index[ref]}: {_cause(exc)}") from exc
    return ray.get(list(refs))


def _cause(exc: BaseException) -> str:
    """The innermost message of a Ray task error (Ray wraps the rank's exception)."""
    cause = getattr(exc, "cause", None) or exc.__cause__
    if cause is None:
        return str(exc)
    return str(cause) if type(cause).__name__ == "RankError" else f"{type(cause).__name__}: {cause}"
