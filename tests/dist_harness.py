"""Run N gloo ranks and collect every rank's outcome, including ranks that exit or die.

tests/mp_utils.run_ranks raises on the first failing rank; fault-injection tests need all outcomes
(some ranks raise a named error, some exit with the watchdog's code), so this collects them all
within one deadline, reusing mp_utils' child bootstrap.
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp

from mp_utils import _child, free_port


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    status: str  # "ok" | "error" (traceback text in value) | "exit" (died without reporting)
    value: Any
    exitcode: int | None


def run_ranks_outcomes(fn: Callable, world_size: int, *, args: Sequence[Any] = (), timeout_s: float = 120.0, pg_timeout_s: float = 60.0) -> list[RankOutcome]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, daemon=True, args=(fn, r, world_size, tuple(args), port, True, pg_timeout_s, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(results, procs, world_size, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _collect(results, procs, world_size: int, timeout_s: float) -> list[RankOutcome]:
    deadline = time.monotonic() + timeout_s
    outcomes: dict[int, RankOutcome] = {}
    while len(outcomes) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(outcomes))} did not finish within {timeout_s:.0f}s")
        try:
            rank, status, value = results.get(timeout=0.5)
            outcomes[rank] = RankOutcome(rank, status, value, None)
        except queue.Empty:
            for r, p in enumerate(procs):
                if r not in outcomes and not p.is_alive() and p.exitcode not in (0, None):
                    outcomes[r] = RankOutcome(r, "exit", None, p.exitcode)
    return [outcomes[r] for r in range(world_size)]
