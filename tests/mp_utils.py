"""Run a function on N local processes joined by a gloo process group, with a hard deadline.

    results = run_ranks(fn, world_size=8, args=(cfg,), timeout_s=120)
    outcomes = run_ranks_outcomes(fn, world_size=8, args=(cfg,), timeout_s=120)

`fn(rank, world_size, *args)` runs in each child after torch.distributed is initialised (unless
init_process_group=False; MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE are always set in the
environment). run_ranks returns every rank's (picklable) return value and raises on the first
rank that fails or dies; run_ranks_outcomes collects every rank's outcome, failures included,
which fault-injection tests need (some ranks raise a named error, others exit with the
watchdog's code). A rank that does not finish by the deadline raises TimeoutError naming the
missing ranks. Every child is gone when either returns.

Ranks fork from one server process per test session that has imported torch, megatron-core, the trainer's
modules and transformers' model tables (PRELOAD): a freshly spawned rank spends ~10 s of CPU on those imports,
which made an 8-rank run on 2 cores cost ~40 s before its first line (transformers' alone ~1 s a rank, measured
0.8 of 1.4 CPU-s of a tiny model's two steps). Each rank gets the caller's environment as it is at the call (a
test's monkeypatched SLIME_FAULT_INJECT), not the server's.
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

from slime.utils.ports import find_free_port

PRELOAD = ("torch", "megatron.core", "slime.backends.megatron_utils.actor", "slime.backends.megatron_utils.model",
           "slime.backends.weight_sync.sync", "slime.backends.embedded_engine.engine",
           "transformers.models.auto")  # after slime.utils: its import-structure cache serves transformers


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    status: str  # "ok" | "error" (traceback text in value) | "exit" (died without reporting)
    value: Any
    exitcode: int | None


def _child(fn, rank, world_size, args, port, init_pg, pg_timeout_s, results, env):
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N ranks share few cores
        if init_pg:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
            )
        # Plain pickle bytes: torch's queue pickler would pass tensors as shared-memory fds,
        # which vanish when this process exits before the parent reads them.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report every failure to the parent, including SystemExit
        results.put((rank, "error", pickle.dumps(traceback.format_exc())))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    init_process_group: bool = True,
    pg_timeout_s: float | None = None,
) -> list[Any]:
    """Run fn on world_size gloo ranks; return [result of rank 0, rank 1, ...]."""
    pg_timeout = pg_timeout_s if pg_timeout_s is not None else timeout_s
    outcomes = _run(fn, world_size, args, timeout_s, init_process_group, pg_timeout, stop_on_failure=True)
    for outcome in outcomes:
        if outcome.status == "error":
            raise RuntimeError(f"rank {outcome.rank} failed:\n{outcome.value}")
        if outcome.status == "exit":
            raise RuntimeError(f"rank {outcome.rank} died without reporting (exit code {outcome.exitcode})")
    return [outcome.value for outcome in outcomes]


def run_ranks_outcomes(fn: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (),
                       timeout_s: float = 120.0, pg_timeout_s: float = 60.0,
                       init_process_group: bool = True) -> list[RankOutcome]:
    """Run fn on world_size gloo ranks; return every rank's outcome, failed and dead ones too."""
    return _run(fn, world_size, args, timeout_s, init_process_group, pg_timeout_s, stop_on_failure=False)


PORT_TRIES = 3


def _run(fn, world_size, args, timeout_s, init_pg, pg_timeout_s, *, stop_on_failure) -> list[RankOutcome]:
    """_run_once on a free port; again on another where the port was taken between its pick and rank 0's listen
    (another process on the machine got it first: the store never started, so no rank ran fn)."""
    for attempt in range(1, PORT_TRIES + 1):
        outcomes = _run_once(fn, world_size, args, timeout_s, init_pg, pg_timeout_s, stop_on_failure=stop_on_failure)
        taken = any(o.status == "error" and "EADDRINUSE" in str(o.value) and "TCPStore" in str(o.value)
                    for o in outcomes)
        if not taken or attempt == PORT_TRIES:
            return outcomes
    return outcomes


def _run_once(fn, world_size, args, timeout_s, init_pg, pg_timeout_s, *, stop_on_failure) -> list[RankOutcome]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the session's server starts
    results = ctx.Queue()
    port = find_free_port()
    procs = [
        # Not daemonic: rank code may start its own processes (dist_checkpointing writers);
        # _stop() kills whatever is left, so nothing outlives the run.
        ctx.Process(target=_child, daemon=False,
                    args=(fn, rank, world_size, tuple(args), port, init_pg, pg_timeout_s, results, dict(os.environ)))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        return _collect(results, procs, world_size, timeout_s, stop_on_failure)
    finally:
        _stop(procs)


def _collect(results, procs, world_size: int, timeout_s: float, stop_on_failure: bool) -> list[RankOutcome]:
    """Every rank's outcome within the deadline; with stop_on_failure, up to the first failure only."""
    deadline = time.monotonic() + timeout_s
    outcomes: dict[int, RankOutcome] = {}
    while len(outcomes) < world_size:
        if stop_on_failure and any(o.status != "ok" for o in outcomes.values()):
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(outcomes))
            raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f}s")
        try:
            rank, status, value = results.get(timeout=min(remaining, 0.5))
            outcomes[rank] = RankOutcome(rank, status, pickle.loads(value), None)
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if rank not in outcomes and not proc.is_alive() and proc.exitcode not in (0, None):
                    outcomes[rank] = RankOutcome(rank, "exit", None, proc.exitcode)
    return [outcomes[rank] for rank in sorted(outcomes)]


def _stop(procs) -> None:
    end = time.monotonic() + 5  # one grace period for all ranks, then kill what is left
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
