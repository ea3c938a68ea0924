"""What --ledger-record-sequence costs: the ledger with and without the sequence file, side by side.

    python benchmarks/bench_ledger_sequence.py [--ops 200000] [--rounds 5]

One process, no process group: a loop of begin/end pairs (the instrumented collective's ledger
work, a hot loop, so an upper bound on the relative cost) on a Ledger whose flusher thread writes
the snapshot only ("off") or the snapshot and the sequence file ("on"), rounds alternating. Prints
the per-op time of each, their ratio, the flusher's time to write one op of the sequence file
(JSON encoding, done off the step's thread but under the GIL), the bytes per op on disk, and how
many ops are missing from the file (must be 0).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from slime.distributed.ledger import Ledger, sequence_path
from slime.distributed.order_proof import read_sequence

SHAPE = (4096, 1, 2048)  # a typical SP all-gather's tensor shape


def loop(ledger: Ledger, ops: int) -> float:
    """Seconds per begin/end pair."""
    start = time.perf_counter()
    with ledger.phase("actor_train/forward_backward"):
        for _ in range(ops):
            ledger.end(ledger.begin_named("all_gather_into_tensor", "tp", (0, 1), SHAPE, "bfloat16"))
    return (time.perf_counter() - start) / ops


def one_round(directory: str, ops: int, record_sequence: bool) -> tuple[float, int, int]:
    """(s per op in the loop, sequence bytes, ops the window dropped before they were written)."""
    ledger = Ledger(0, 2, directory, record_sequence=record_sequence)
    per_op = loop(ledger, ops)
    ledger.close()
    if not record_sequence:
        return per_op, 0, 0
    path = sequence_path(directory, 0)
    sequence = read_sequence(path, 0)
    return per_op, os.path.getsize(path), ops - len(sequence.ops)


def flush_cost_per_op(directory: str, ops: int) -> float:
    """The sequence file's write of `ops` new ops, timed alone (no loop running), per op."""
    ledger = Ledger(0, 2, directory, record_sequence=True, flush_interval_s=3600, max_entries=ops + 1)
    loop(ledger, ops)
    start = time.perf_counter()
    ledger.flush()
    cost = (time.perf_counter() - start) / ops
    ledger.close()
    return cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results: dict[bool, list[float]] = {False: [], True: []}
    sizes, dropped = [], 0
    with tempfile.TemporaryDirectory() as directory:
        for index in range(args.rounds):
            for record_sequence in ((False, True) if index % 2 else (True, False)):  # order alternates
                per_op, size, lost = one_round(directory, args.ops, record_sequence)
                results[record_sequence].append(per_op)
                if record_sequence:
                    sizes.append(size)
                    dropped += lost
        flush = flush_cost_per_op(directory, min(args.ops, 50_000))
    off, on = statistics.median(results[False]), statistics.median(results[True])
    print(json.dumps({
        "ops_per_round": args.ops,
        "rounds": args.rounds,
        "loop_us_per_op_off": round(off * 1e6, 3),
        "loop_us_per_op_on": round(on * 1e6, 3),
        "ratio_on_over_off": round(on / off, 3),
        "sequence_write_us_per_op": round(flush * 1e6, 3),
        "sequence_bytes_per_op": round(statistics.median(sizes) / args.ops, 1),
        "ops_missing_from_file": dropped,
    }, indent=1))


if __name__ == "__main__":
    main()
