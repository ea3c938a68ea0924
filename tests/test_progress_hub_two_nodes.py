"""Rank progress across two Ray nodes that share no ledger directory, through the driver's progress hub.

Ray's multi-node cluster on this machine (tests/ray_cluster.py), the second node on 127.0.0.2. One
rank per node, each with a real ledger in its node's own directory, a real watchdog and the hub's
client; the hub is the Ray actor train.py's driver starts (slime/ray/driver/trainer_group.py), on the
driver's node; the driver waits with `wait_ranks` and renders the hub's table, as RayTrainGroup
does. The ranks are stand-ins without megatron: what is tested is the channel between nodes.

  healthy   rank 0 (node 1, its wall clock an hour behind) writes a checkpoint for 3.5 windows,
            ticking progress; rank 1 (node 2) waits at a fence for it all along and does not trip.
            Control: the same wait, judged from rank 1's ledger directory alone, trips.
  stalled   rank 0 stops making progress; both ranks trip about one window later, and the
            driver's one table, from the hub, shows both nodes' ranks with rank 0 to blame.
Both run twice: the ranks calling the hub, and calling their node's relay, which forwards to it.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from ray_cluster import RayTestCluster, second_loopback_address

from slime.utils.deadlines import HUB_CALL_S

pytestmark = pytest.mark.e2e

WINDOW_S = 3.0
SKEW_S = -3600.0
TESTS = Path(__file__).resolve().parent


class HubRank:
    """One rank without megatron: its ledger in its node's own directory, a watchdog, the hub's client."""

    def __init__(self, rank: int, world: int, ledger_dir: str, hub: tuple, skew_s: float = 0.0, relay: bool = False):
        if skew_s:  # this node's wall clock (every time the process reads) is off by skew_s
            import slime.distributed.ledger as ledger_module

            real = time.time
            time.time = lambda: real() + skew_s
            ledger_module._now = time.time
        from slime.distributed import Ledger, Watchdog
        from slime.distributed.progress_hub import HubClient, RayHub
        from slime.distributed.progress_relay import node_relay

        if relay:  # through its node's relay, as ranks of a large world are
            hub = node_relay(hub)
        self.rank = rank
        self.ledger = Ledger(rank, world, ledger_dir, flush_interval_s=0.1)
        self.client = HubClient(RayHub(*hub), self.ledger)
        self.ledger.hub = self.client
        self.watchdog = Watchdog(WINDOW_S, ledger_dir, rank, world, ledger=self.ledger, grace_s=5.0)
        self.ledger_dir = ledger_dir

    def where(self) -> dict:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "files": sorted(os.listdir(self.ledger_dir))}

    def checkpoint(self, seconds: float) -> str:
        """A long healthy phase: bytes written every 0.1 s."""
        with self._raising_rank_error(), self.watchdog.phase("save"):
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(0.1)
                self.ledger.note_progress()
        return "saved"

    def wait_at_fence(self, seconds: float, use_hub: bool = True) -> str:
        """Blocked at a fence rank 0 has not reached (no progress of its own) for `seconds`."""
        self.ledger.hub = self.client if use_hub else None  # False: peers from this node's files alone
        with self._raising_rank_error(), self.watchdog.phase("weight_sync"):
            entry = self.ledger.begin_named("fence:push", "fence", (0, 1))
            try:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    time.sleep(0.05)
            except BaseException as exc:
                self.ledger.end(entry, error=f"{type(exc).__name__}")
                raise
            self.ledger.end(entry)
        return "passed"

    def stall(self, seconds: float) -> str:
        with self._raising_rank_error(), self.watchdog.phase("save"):
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(0.05)
        return "not tripped"

    def _raising_rank_error(self):
        import contextlib

        from slime.ray.trainer.rank_actor import RankError

        @contextlib.contextmanager
        def portable():
            try:
                yield
            except Exception as exc:  # the watchdog's error, as train ranks carry it to the driver
                raise RankError(f"{type(exc).__name__}: {exc}", "", stalled=True) from None

        return portable()


@pytest.fixture(scope="module", params=[False, True], ids=["direct", "node-relays"])
def two_ranks(request, tmp_path_factory):
    """Two nodes, the hub on the driver's, one rank per node, each node's ledger directory its own; the
    ranks reach the hub directly, or through their node's relay (slime/distributed/progress_relay.py)."""
    import ray

    from slime.distributed.progress_hub import HubClient, RayHub, start_hub

    root = tmp_path_factory.mktemp("hub-two-nodes")
    second = {"node_ip_address": ip} if (ip := second_loopback_address()) else {}
    if ray.is_initialized():
        ray.shutdown()
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]), "OMP_NUM_THREADS": "1"}}
    with RayTestCluster([{"num_cpus": 1}, {"num_cpus": 1, **second}]) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            hub = start_hub(2, runtime_env=env)
            ray.get(hub[0].stats.remote(), timeout=120)  # up before the ranks count on it
            remote = ray.remote(HubRank).options(num_cpus=1, runtime_env=env)
            relay = request.param
            ranks = [remote.remote(0, 2, str(root / "node1"), hub, SKEW_S, relay),
                     remote.remote(1, 2, str(root / "node2"), hub, 0.0, relay)]
            driver = HubClient(RayHub(*hub))
            yield {"ranks": ranks, "driver": driver, "where": ray.get([r.where.remote() for r in ranks], timeout=120)}
            driver.close()
        finally:
            ray.shutdown()


def _wait(two_ranks, refs, phase: str):
    from slime.distributed.progress import hang_table
    from slime.ray.driver.rank_wait import wait_ranks

    driver = two_ranks["driver"]
    # above the ranks' window, as the driver's is (slime/utils/deadlines.py), and above one hub call's deadline, as
    # the driver's always is: a window shorter than a call would call a hub that answers slowly unreachable
    window = 1.5 * WINDOW_S + HUB_CALL_S
    return wait_ranks(refs, phase=phase, window_s=window, progress=lambda: driver.latest_progress(window),
                      describe_hang=lambda: hang_table(driver, 2, None), poll_s=0.5)


@pytest.mark.timeout(240)
def test_a_long_phase_on_one_node_keeps_the_other_nodes_waiting_rank_alive(two_ranks):
    import ray

    rank0, rank1 = two_ranks["ranks"]
    nodes = [w["node_id"] for w in two_ranks["where"]]
    assert nodes[0] != nodes[1]
    assert "rank0.json" not in two_ranks["where"][1]["files"]  # nothing shared between the nodes
    long = 3.5 * WINDOW_S
    assert _wait(two_ranks, [rank0.checkpoint.remote(long), rank1.wait_at_fence.remote(long)], "save") \
        == ["saved", "passed"]
    from slime.ray.driver.rank_wait import RankFailedError

    control = [rank0.checkpoint.remote(2 * WINDOW_S), rank1.wait_at_fence.remote(long, False)]
    with pytest.raises(RankFailedError, match=r"rank 1: HangError: HANG: phase=weight_sync"):
        _wait(two_ranks, control, "save")
    assert ray.get(control[0], timeout=60) == "saved"  # rank 0 was healthy all along


@pytest.mark.timeout(240)
def test_a_stalled_rank_is_named_in_the_drivers_one_table_of_both_nodes(two_ranks):
    from slime.ray.driver.rank_wait import RankFailedError

    rank0, rank1 = two_ranks["ranks"]
    started = time.monotonic()
    with pytest.raises(RankFailedError) as err:
        _wait(two_ranks, [rank0.stall.remote(30), rank1.wait_at_fence.remote(30)], "save")
    assert time.monotonic() - started < WINDOW_S + 8
    assert "HangError: HANG: phase=" in str(err.value) and "stuck ranks=[0]" in str(err.value), err.value
    rows = {line.split()[0]: line for line in err.value.details.splitlines() if line[:1].isdigit()}
    assert set(rows) == {"0", "1"}, err.value.details
    assert "SUSPECT" in rows["0"] and "fence:push" in rows["1"] and "fence[0,1]" in rows["1"], err.value.details
