"""Run N gloo ranks and collect every rank's outcome, including ranks that exit or die.

tests/mp_utils.run_ranks raises on the first failing rank; fault-injection tests need all outcomes
(some ranks raise a named error, some exit with the watchdog's code), so this collects them all
within one deadline.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp

from mp_utils import free_port


def _child(fn, rank, world_size, args, port, pg_timeout_s, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))  # plain bytes: no shared-memory fds
    except BaseException:
        results.put((rank, "error", pickle.dumps(traceback.format_exc())))


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
        ctx.Process(target=_child, daemon=True, args=(fn, r, world_size, tuple(args), port, pg_timeout_s, results))
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
            outcomes[rank] = RankOutcome(rank, status, pickle.loads(value), None)
        except queue.Empty:
            for r, p in enumerate(procs):
                if r not in outcomes and not p.is_alive() and p.exitcode not in (0, None):
                    outcomes[r] = RankOutcome(r, "exit", None, p.exitcode)
    return [outcomes[r] for r in range(world_size)]
