"""How rank progress scales: N heartbeat publishers against the progress hub, and today's file read, side by side.

    python benchmarks/bench_progress_scale.py [--ranks 8 64 256 1024] [--window 5] [--measure 8]

Per N, on a local Ray instance (loopback), the real hub actor (slime/distributed/progress_hub.py)
and N real HubClients, each a daemon thread with its own ledger standing in for a rank (threads of
this process, not processes: 1,024 Ray workers do not fit a small machine). Every "rank" is in a
world group and in one group of 8 (as a DP/TP group would be) and makes progress every 0.1 s; its
client sends a heartbeat at most once a second, as in training. Then one rank stops making
progress (its client keeps running, as a hung rank's thread does) and rank 0's aggregate is
watched until it names that rank as its world group's slowest member with no progress for the
window: the detection time (the bound: one window plus 2 s).

Printed per N:
  publish p50/p99   one call to the hub (heartbeat out, aggregate back), seen from the rank
  hub cpu           the hub actor's CPU time over wall time while N ranks publish
  staleness p50/p99 how far behind the truth (every rank progresses every 0.1 s) the "latest
                    progress anywhere" of the ranks' aggregates is, sampled across ranks
  detect            stop -> rank 0 sees the stopped rank behind by a window
  files: read, files/s   today's rule: one quiet rank reads N ledger files (time per read, files
                    per second that gives); at scale every quiet rank does so each second, i.e.
                    N*N files/s wanted ("wanted/s")
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from slime.distributed.ledger import Ledger  # noqa: E402
from slime.distributed.progress import latest_file_progress  # noqa: E402
from slime.distributed.progress_hub import HubClient, HubState, LocalHub, RayHub, start_hub  # noqa: E402

TICK_S = 0.1
GROUP = 8


class TimedTransport:
    """The transport, timing every call (the publish latency): (when it ended, seconds) per call."""

    def __init__(self, inner, durations: list):
        self.inner = inner
        self.name = inner.name
        self.durations = durations

    def call(self, method, *args, timeout_s):
        start = time.monotonic()
        try:
            return self.inner.call(method, *args, timeout_s=timeout_s)
        finally:
            end = time.monotonic()
            self.durations.append((end, end - start))


def rank_ledger(rank: int, world: int, directory: str | None = None) -> Ledger:
    """A rank's ledger with the ops of a step on its groups (world, its group of 8)."""
    ledger = Ledger(rank, world, directory, flush_interval_s=3600)
    base = rank - rank % GROUP
    groups = [("fence", tuple(range(world))), ("dp", tuple(range(base, min(base + GROUP, world))))]
    with ledger.phase("actor_train"):
        for i in range(40):
            name, ranks = groups[i % 2]
            ledger.end(ledger.begin_named("all_reduce", name, ranks, (1024,), "float32"))
    return ledger


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def hub_round(world: int, args, transport_for) -> dict:
    durations: list[float] = []
    transport, stats = transport_for(world)
    ledgers = [rank_ledger(r, world) for r in range(world)]
    clients = [HubClient(TimedTransport(transport, durations), ledger, call_timeout_s=args.call_timeout)
               for ledger in ledgers]
    stopped: set[int] = set()
    done = threading.Event()

    def tick() -> None:  # every rank but the stopped one progresses every TICK_S
        while not done.wait(TICK_S):
            for ledger in ledgers:
                if ledger.rank not in stopped:
                    ledger.note_progress()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    time.sleep(2.0)  # every client has sent its first heartbeat
    cpu0, begin = stats(), time.monotonic()
    staleness = []
    end = begin + args.measure
    step = max(1, world // 64)
    while time.monotonic() < end:
        time.sleep(0.25)
        now = time.time()
        staleness += [now - c.latest.latest_progress for c in clients[::step] if c.latest]
    wall = time.monotonic() - begin
    cpu = (stats() - cpu0) / wall
    publish = [seconds for at, seconds in list(durations) if begin <= at <= begin + wall]
    victim = world - 1
    label = f"fence[{','.join(map(str, range(world)))}]"
    stopped.add(victim)
    time.sleep(2 * TICK_S)  # the ticker's round in progress has ended
    stop_at = ledgers[victim].progress_at  # its last progress
    detect = float("nan")
    limit = time.monotonic() + args.window + 30
    while time.monotonic() < limit:
        latest = clients[0].latest
        slowest = latest.slowest.get(label) if latest else None
        if slowest and slowest[0] == victim and slowest[1] >= args.window:
            detect = latest.received_at - stop_at  # when rank 0 held the answer
            break
        time.sleep(0.02)
    done.set()
    for client in clients:
        client.close()
    return {"publish_p50": percentile(publish, 0.5), "publish_p99": percentile(publish, 0.99),
            "calls_s": len(publish) / wall, "hub_cpu": cpu, "stale_p50": percentile(staleness, 0.5),
            "stale_p99": percentile(staleness, 0.99), "detect": detect}


def file_round(world: int, repeats: int = 3) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-progress-") as directory:
        for r in range(world):
            rank_ledger(r, world, directory).close()
        size = os.path.getsize(os.path.join(directory, "rank0.json"))
        latest_file_progress(directory, world)  # warm the page cache once, as a rereading rank has it
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            latest_file_progress(directory, world)
            times.append(time.perf_counter() - start)
    read = statistics.median(times)
    return {"read_s": read, "files_s": world / read, "wanted_s": world * world, "file_bytes": size}


def ray_transport(world: int):
    handle, name = start_hub(world, max_pending_calls=4 * world)  # one process holds every "rank"
    import ray

    ray.get(handle.stats.remote(), timeout=60)  # started
    return RayHub(handle, name), lambda: ray.get(handle.stats.remote(), timeout=30)["cpu_s"]


def local_transport(world: int):
    return LocalHub(HubState(world)), time.process_time  # the whole process: an upper bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--window", type=float, default=5.0, help="the no-progress window detection is held to")
    parser.add_argument("--measure", type=float, default=8.0, help="seconds of steady publishing per N")
    parser.add_argument("--call-timeout", type=float, default=10.0)
    parser.add_argument("--hub", choices=["ray", "local"], default="ray",
                        help="ray: the hub actor (what training uses); local: its state in this process")
    args = parser.parse_args()
    transport_for = local_transport
    if args.hub == "ray":
        import ray

        from slime.patches.ray import keep_cluster_on_loopback
        from slime.ray.common.node import LOOPBACK

        keep_cluster_on_loopback()  # a private cluster of this machine: nothing leaves loopback
        ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False,
                 log_to_driver=False, _node_ip_address=LOOPBACK)
        transport_for = ray_transport
    print(f"hub={args.hub} window={args.window:g}s cpus={os.cpu_count()} heartbeat interval 1s, progress every "
          f"{TICK_S:g}s")
    header = (f"{'N':>5} {'publish p50':>11} {'p99':>8} {'calls/s':>8} {'hub cpu':>8} {'stale p50':>9} "
              f"{'p99':>6} {'detect':>7} | {'file read':>9} {'files/s':>9} {'wanted/s':>9} {'bytes':>6}")
    print(header)
    print("-" * len(header))
    for world in args.ranks:
        hub = hub_round(world, args, transport_for)
        files = file_round(world)
        verdict = "ok" if hub["detect"] <= args.window + 2.0 else "LATE"
        print(f"{world:>5} {hub['publish_p50'] * 1e3:>9.1f}ms {hub['publish_p99'] * 1e3:>6.1f}ms "
              f"{hub['calls_s']:>8.0f} {hub['hub_cpu'] * 100:>7.0f}% {hub['stale_p50']:>8.2f}s "
              f"{hub['stale_p99']:>5.2f}s {hub['detect']:>6.2f}s | {files['read_s'] * 1e3:>7.1f}ms "
              f"{files['files_s']:>9.0f} {files['wanted_s']:>9.0f} {files['file_bytes']:>6} {verdict}", flush=True)


if __name__ == "__main__":
    main()
