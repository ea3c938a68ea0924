"""Run a function on N local processes joined by a gloo process group, with a hard deadline.

    results = run_ranks(fn, world_size=8, args=(cfg,), timeout_s=120)

`fn(rank, world_size, *args)` runs in each child after torch.distributed is initialised (unless
init_process_group=False; MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE are always set in the
environment). Its return value (picklable) is collected per rank. A child that raises makes
run_ranks raise with that rank's traceback; a child that does not finish by the deadline makes
it raise TimeoutError naming the missing ranks. Every child is gone when run_ranks returns.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(fn, rank, world_size, args, port, init_pg, pg_timeout_s, results):
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
        value = fn(rank, world_size, *args)
        # Plain pickle bytes: torch's queue pickler would pass tensors as shared-memory fds,
        # which vanish when this process exits before the parent reads them.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # report every failure to the parent, including SystemExit
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    init_process_group: bool = True,
    pg_timeout_s: float | None = None,
    start_method: str = "spawn",
) -> list[Any]:
    """Run fn on world_size gloo ranks; return [result of rank 0, rank 1, ...]."""
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    pg_timeout = pg_timeout_s if pg_timeout_s is not None else timeout_s
    procs = [
        # Not daemonic: rank code may start its own processes (dist_checkpointing writers);
        # _stop() kills whatever is left, so nothing outlives run_ranks.
        ctx.Process(target=_child, daemon=False,
                    args=(fn, rank, world_size, tuple(args), port, init_process_group, pg_timeout, results))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        return _collect(results, procs, world_size, timeout_s)
    finally:
        _stop(procs)


def _collect(results, procs, world_size: int, timeout_s: float) -> list[Any]:
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    values: dict[int, Any] = {}
    while len(values) < world_size:
        remaining = (deadline - datetime.datetime.now()).total_seconds()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(values))
            raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f}s")
        try:
            rank, status, value = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in values and not p.is_alive()
                    and p.exitcode not in (0, None)]
            if dead:
                raise RuntimeError(f"ranks {dead} died without reporting "
                                   f"(exit codes {[procs[r].exitcode for r in dead]})")
            continue
        if status == "error":
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        values[rank] = pickle.loads(value)
    return [values[rank] for rank in range(world_size)]


def _stop(procs) -> None:
    for proc in procs:
        proc.join(timeout=5)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
