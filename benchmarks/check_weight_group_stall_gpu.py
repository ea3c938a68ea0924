"""The weight-update group's deadline on NCCL: a stalled engine rank ends the sender's push with a named error.

    python benchmarks/check_weight_group_stall_gpu.py [--deadline 5] [--json out.json]    # two GPUs
    python benchmarks/check_weight_group_stall_gpu.py --backend gloo                      # the logic, on CPU

The sender (this process, cuda:0) hosts a weight-update group of two ranks; the engine's rank (a child
process, cuda:1) joins it over NCCL, as an engine does. Then:
  healthy  rounds of 64 tensors of 4 MiB each: the sender's `broadcast_all` (issue all, poll each one's
           completion against a deadline) against issuing them and `torch.cuda.synchronize()`; prints
           the ratio of the two medians (the poll's cost)
  stall    the engine's rank stops taking part; the sender's next `broadcast_all` must raise
           CollectiveStallError at its deadline (not hang, not be ended by NCCL's watchdog, whose limit is
           set 60 s above), with the communicator aborted; the sender then stays up 15 s more
Prints one line per check and `ok` or the first failure; exits non-zero on a failure.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

from slime.distributed.external_group import (
    CollectiveStallError,
    ExternalGroupSpec,
    hosted_store,
    open_external_group,
)

TENSORS, TENSOR_BYTES, ROUNDS = 64, 4 * 1024**2, 5
WATCHDOG_MARGIN_S = 60.0
STAY_UP_S = 15.0
JOIN_S = 120.0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deadline", type=float, default=5.0, help="seconds the stalled push may take")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def _device(backend: str, index: int) -> torch.device:
    return torch.device(f"cuda:{index}") if backend == "nccl" else torch.device("cpu")


def _tensors(device: torch.device) -> list[torch.Tensor]:
    return [torch.zeros(TENSOR_BYTES // 4, device=device) for _ in range(TENSORS)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_rank(spec: ExternalGroupSpec, rounds: int, ready, stall_s: float) -> None:
    """The engine's side: join, receive every healthy round, then stop taking part."""
    device = _device(spec.backend, 1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = open_external_group(spec, 1)
    tensors = _tensors(device)
    for _ in range(rounds):
        for tensor in tensors:
            group.broadcast(tensor, 0)
        _sync(device)
    ready.put("stalling")
    time.sleep(stall_s)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = _device(args.backend, 0)
    if device.type == "cuda":
        if torch.cuda.device_count() < 2:
            print("needs two GPUs (or --backend gloo for the logic on CPU)")
            return 2
        torch.cuda.set_device(device)
    store = hosted_store("127.0.0.1", 2, datetime.timedelta(seconds=120))
    spec = ExternalGroupSpec(master_address="127.0.0.1", master_port=store.port, world_size=2,
                             group_name="stall_check", backend=args.backend, timeout_s=JOIN_S,
                             watchdog_timeout_s=args.deadline + WATCHDOG_MARGIN_S)  # the join: a spawned process
    context = mp.get_context("spawn")
    ready = context.Queue()
    rounds = 2 * ROUNDS + 1  # one warm-up (the communicator is made on the first broadcast), then both methods
    engine = context.Process(target=engine_rank, args=(spec, rounds, ready, args.deadline + STAY_UP_S + 30))
    engine.start()
    results: dict[str, float | str] = {"backend": args.backend, "deadline_s": args.deadline}
    try:
        sender = open_external_group(spec, 0, store=store)
        tensors = _tensors(device)
        sender.broadcast_all(tensors, deadline=time.monotonic() + 120)  # warm-up
        polled, synced = [], []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            sender.broadcast_all(tensors, deadline=time.monotonic() + 120)
            polled.append(time.perf_counter() - start)
            start = time.perf_counter()
            for work in [sender.group.broadcast(tensor, 0) for tensor in tensors]:
                work.wait()
            _sync(device)
            synced.append(time.perf_counter() - start)
        results.update(poll_s=statistics.median(polled), synchronize_s=statistics.median(synced))
        results["poll_over_synchronize"] = results["poll_s"] / results["synchronize_s"]
        print(f"healthy: {TENSORS} x {TENSOR_BYTES >> 20} MiB, broadcast_all {results['poll_s']:.4f}s, "
              f"issue + synchronize {results['synchronize_s']:.4f}s, ratio {results['poll_over_synchronize']:.3f}")

        ready.get(timeout=120)
        start = time.monotonic()
        try:
            sender.broadcast_all(tensors, deadline=start + args.deadline)
            results["stall"] = "FAILED: the push to a stalled rank returned"
        except CollectiveStallError as exc:
            results["stall_s"] = time.monotonic() - start
            results["stall"] = f"CollectiveStallError after {results['stall_s']:.2f}s: {exc}"
        print(f"stall: {results['stall']}")
        time.sleep(STAY_UP_S)  # NCCL's watchdog would end this process here if the abort had not
        results["alive_after_s"] = STAY_UP_S
        print(f"sender still up {STAY_UP_S:g}s after the stall")
    finally:
        engine.kill()
        engine.join(timeout=10)
    ok = "stall_s" in results and results["stall_s"] < args.deadline + 5
    results["ok"] = ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
