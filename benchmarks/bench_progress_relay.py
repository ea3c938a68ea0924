"""The progress hub behind node relays, simulated to 8,192 ranks (1,024 nodes of 8), beside 1,024 ranks.

    python benchmarks/bench_progress_relay.py [--nodes 128 1024] [--per-node 8] [--hosts 4] [--window 5] [--measure 8]

Per size, on a local Ray instance (loopback): the real hub actor (slime/distributed/progress_hub.py) and
one real NodeRelay (slime/distributed/progress_relay.py) per simulated node, each with `--per-node`
real HubClients and ledgers standing in for its ranks. The nodes live in `--hosts` Ray actors (processes),
one thread per node: each interval (1 s, as in training) the node's ranks exchange with their relay and the
relay forwards to the hub once, so the hub hears one caller per node. No process holds 8,192 threads
(1,024 node threads over 4 processes). Every rank is in a world group and its node's group and makes
progress every 0.1 s; then the last rank stops (its client keeps running, as a hung rank's does) and rank 0,
on another node and process, is watched until its aggregate names that rank as its world group's slowest
member with no progress for the window: the detection time (the bound: one window plus 2 s).

Printed per size:
  forward p50/p99   one relay call to the hub (the node's heartbeats out, its ranks' aggregates back)
  calls/s           calls the hub answers a second
  hub cpu           the hub actor's CPU time over wall time while every node forwards
  staleness p50/p99 how far behind the truth (every rank progresses every 0.1 s) the "latest progress
                    anywhere" of the ranks' aggregates is, sampled across ranks
  detect            stop -> rank 0 sees the stopped rank behind by a window
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from slime.distributed.ledger import Ledger  # noqa: E402
from slime.distributed.progress_hub import HubClient, RayHub, start_hub  # noqa: E402
from slime.distributed.progress_relay import NodeRelay  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_progress_scale import TimedTransport, percentile  # noqa: E402  (the direct hub's benchmark)

TICK_S = 0.1
INTERVAL_S = 1.0


def node_ledger(rank: int, world_group: tuple[int, ...], node_group: tuple[int, ...]) -> Ledger:
    """A rank's ledger with ops on its groups (the world, its node's)."""
    ledger = Ledger(rank, len(world_group), None)
    with ledger.phase("actor_train"):
        for name, ranks in (("fence", world_group), ("tp", node_group)) * 2:
            ledger.end(ledger.begin_named("all_reduce", name, ranks, (1024,), "float32"))
    return ledger


class NodeHost:
    """One process holding some simulated nodes: their relays, ranks' ledgers and clients, one thread a node."""

    def __init__(self, hub_handle, hub_name: str, nodes: list[int], per_node: int, world: int):
        self.durations: list = []
        transport = TimedTransport(RayHub(hub_handle, hub_name), self.durations)
        world_group = tuple(range(world))
        self.ledgers: dict[int, Ledger] = {}
        self.nodes = []
        for node in nodes:
            relay = NodeRelay(transport, f"n{node}", interval_s=INTERVAL_S, call_timeout_s=30.0, start=False)
            ranks = tuple(range(node * per_node, (node + 1) * per_node))
            clients = []
            for rank in ranks:
                ledger = self.ledgers[rank] = node_ledger(rank, world_group, ranks)
                clients.append(HubClient(relay, ledger, interval_s=INTERVAL_S, call_timeout_s=30.0, start=False))
            self.nodes.append((relay, clients))
        self.clients = {c.rank: c for _, clients in self.nodes for c in clients}
        self.stopped: set[int] = set()
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._node_loop, args=(i,), daemon=True)
                        for i in range(len(self.nodes))] + [threading.Thread(target=self._tick, daemon=True)]
        self.world_label = f"fence[{','.join(map(str, world_group))}]"

    def start(self) -> int:
        for i, thread in enumerate(self.threads):
            thread.start()
            if i % 64 == 63:
                time.sleep(0.05)  # spread the nodes' phases over the interval
        return len(self.ledgers)

    def _node_loop(self, index: int) -> None:
        relay, clients = self.nodes[index]
        while not self.done.is_set():
            begun = time.monotonic()
            for client in clients:
                client.exchange()
            relay.forward()
            self.done.wait(max(0.0, INTERVAL_S - (time.monotonic() - begun)))

    def _tick(self) -> None:
        while not self.done.wait(TICK_S):
            for rank, ledger in self.ledgers.items():
                if rank not in self.stopped:
                    ledger.note_progress()

    def sample(self, since: float, until: float) -> dict:
        """Forward latencies in [since, until] (monotonic) and the staleness of some ranks' aggregates now."""
        forwards = [s for at, s in list(self.durations) if since <= at <= until]
        now = time.time()
        clients = list(self.clients.values())[:: max(1, len(self.clients) // 32)]
        return {"forwards": forwards,
                "stale": [now - c.latest.latest_progress for c in clients if c.latest and c.latest.latest_age_s is not None]}

    def stop(self, rank: int) -> float:
        self.stopped.add(rank)
        time.sleep(2 * TICK_S)
        return self.ledgers[rank].progress_at

    def seen(self, watcher: int, victim: int, window_s: float) -> float | None:
        """When `watcher` held an aggregate naming `victim` a window behind (None: not yet)."""
        latest = self.clients[watcher].latest
        slowest = latest.slowest.get(self.world_label) if latest else None
        if slowest and slowest[0] == victim and slowest[1] >= window_s:
            return latest.received_at
        return None

    def close(self) -> None:
        self.done.set()


def round_of(nodes: int, args) -> dict:
    import ray

    world = nodes * args.per_node
    handle, name = start_hub(world, max_pending_calls=4 * nodes)
    ray.get(handle.stats.remote(), timeout=60)
    split = [list(range(nodes))[h::args.hosts] for h in range(args.hosts)]
    host_cls = ray.remote(NodeHost).options(num_cpus=0, max_concurrency=4)
    hosts = [host_cls.remote(handle, name, part, args.per_node, world) for part in split]
    ray.get([h.start.remote() for h in hosts], timeout=600)
    time.sleep(3.0)  # every node has forwarded its ranks' first heartbeats
    cpu0, begin = ray.get(handle.stats.remote(), timeout=30), time.monotonic()
    stale = []
    while time.monotonic() < begin + args.measure:
        time.sleep(1.0)
        stale += [s for part in ray.get([h.sample.remote(0, 0) for h in hosts], timeout=60) for s in part["stale"]]
    wall = time.monotonic() - begin
    cpu1 = ray.get(handle.stats.remote(), timeout=30)
    samples = ray.get([h.sample.remote(begin, begin + wall) for h in hosts], timeout=60)
    forwards = [s for part in samples for s in part["forwards"]]
    victim = world - 1
    victim_host = hosts[split.index(next(p for p in split if victim // args.per_node in p))]
    stop_at = ray.get(victim_host.stop.remote(victim), timeout=30)
    detect = float("nan")
    limit = time.monotonic() + args.window + 30
    while time.monotonic() < limit:
        seen = ray.get(hosts[0].seen.remote(0, victim, args.window), timeout=30)
        if seen is not None:
            detect = seen - stop_at
            break
        time.sleep(0.05)
    ray.get([h.close.remote() for h in hosts], timeout=30)
    for host in hosts:
        ray.kill(host)
    ray.kill(handle)
    return {"world": world, "nodes": nodes, "forward_p50": percentile(forwards, 0.5),
            "forward_p99": percentile(forwards, 0.99), "calls_s": (cpu1["calls"] - cpu0["calls"]) / wall,
            "hub_cpu": (cpu1["cpu_s"] - cpu0["cpu_s"]) / wall, "stale_p50": percentile(stale, 0.5),
            "stale_p99": percentile(stale, 0.99), "detect": detect}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--hosts", type=int, default=4, help="processes the simulated nodes are spread over")
    parser.add_argument("--window", type=float, default=5.0, help="the no-progress window detection is held to")
    parser.add_argument("--measure", type=float, default=8.0, help="seconds of steady forwarding per size")
    args = parser.parse_args()
    import ray

    from slime.patches.ray import keep_cluster_on_loopback
    from slime.ray.common.node import LOOPBACK

    keep_cluster_on_loopback()  # a private cluster of this machine: nothing leaves loopback
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False,
             _node_ip_address=LOOPBACK)
    print(f"hub behind node relays: {args.per_node} ranks a node, nodes in {args.hosts} processes, "
          f"window={args.window:g}s cpus={os.cpu_count()} interval {INTERVAL_S:g}s, progress every {TICK_S:g}s")
    header = (f"{'ranks':>6} {'nodes':>6} {'forward p50':>11} {'p99':>8} {'calls/s':>8} {'hub cpu':>8} "
              f"{'stale p50':>9} {'p99':>6} {'detect':>7}")
    print(header)
    print("-" * len(header))
    for nodes in args.nodes:
        r = round_of(nodes, args)
        verdict = "ok" if r["detect"] <= args.window + 2.0 else "LATE"
        print(f"{r['world']:>6} {r['nodes']:>6} {r['forward_p50'] * 1e3:>9.1f}ms {r['forward_p99'] * 1e3:>6.1f}ms "
              f"{r['calls_s']:>8.0f} {r['hub_cpu'] * 100:>7.0f}% {r['stale_p50']:>8.2f}s {r['stale_p99']:>5.2f}s "
              f"{r['detect']:>6.2f}s {verdict}", flush=True)


if __name__ == "__main__":
    main()
