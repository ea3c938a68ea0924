"""Node relays in front of the progress hub: one call per node, the stalled rank still named, ages that
keep running between forwards, no heartbeat label lost, and a silent hub still named by every rank.

Single-process tests: the hub's state behind an in-process transport, one NodeRelay per simulated
node forwarding by hand (start=False) or on its own thread, real ledgers and watchdogs.
"""
from __future__ import annotations

import time

import pytest

from slime.distributed import HangError, HubUnreachableError, Ledger, Watchdog
from slime.distributed.progress_hub import HubClient, HubState, LocalHub
from slime.distributed.progress_relay import NodeRelay

INTERVAL_S = 0.2
LOAD_SLACK_S = 5.0  # a loaded two-core machine's scheduling delay; the bounds stay far below the 20 s waits


class CountingHub(LocalHub):
    """The in-process hub, counting calls by method."""

    def __init__(self, state: HubState):
        super().__init__(state)
        self.calls: dict[str, int] = {}

    def call(self, method, *args, timeout_s):
        self.calls[method] = self.calls.get(method, 0) + 1
        return super().call(method, *args, timeout_s=timeout_s)


def _world(tmp_path, nodes: int, per_node: int, *, start: bool):
    """Ranks on `nodes` nodes of `per_node`, every rank in the world fence group and its node's group."""
    world = nodes * per_node
    hub = CountingHub(HubState(world))
    relays = [NodeRelay(hub, f"n{n}", interval_s=INTERVAL_S, call_timeout_s=1.0, start=start) for n in range(nodes)]
    ledgers, clients = [], []
    for rank in range(world):
        node = rank // per_node
        ledger = Ledger(rank, world, str(tmp_path / f"node{node}"), flush_interval_s=0.05)
        local = tuple(range(node * per_node, (node + 1) * per_node))
        ledger.end(ledger.begin_named("all_reduce", "fence", tuple(range(world))))
        ledger.end(ledger.begin_named("all_reduce", "tp", local))
        ledger.hub = HubClient(relays[node], ledger, interval_s=INTERVAL_S, call_timeout_s=1.0, start=start)
        ledgers.append(ledger)
        clients.append(ledger.hub)
    return hub, relays, ledgers, clients


def _round(relays, clients) -> None:
    """One interval by hand: every rank exchanges with its relay, every relay forwards to the hub."""
    for client in clients:
        client.exchange()
    for relay in relays:
        relay.forward()


def test_the_hub_hears_one_call_per_node_and_names_the_stalled_rank(tmp_path):
    hub, relays, ledgers, clients = _world(tmp_path, nodes=4, per_node=4, start=False)
    _round(relays, clients)
    _round(relays, clients)
    assert hub.calls == {"beat_node": 8}  # 4 nodes x 2 rounds; 16 ranks never call the hub themselves
    assert sorted(hub.state.ranks) == list(range(16))
    world = "fence[" + ",".join(map(str, range(16))) + "]"
    stalled = 13
    time.sleep(0.3)
    for ledger in ledgers:
        if ledger.rank != stalled:
            ledger.note_progress()
    _round(relays, clients)  # every node's new heartbeats reach the hub
    time.sleep(0.3)  # the hub recomputes a group's slowest member at most every 0.2 s
    _round(relays, clients)
    for client in clients:
        client.exchange()  # the answers of that forward, from the relays
    rank, behind_s, _ = clients[0].latest.slowest[world]  # rank 0, on another node, names rank 13
    assert rank == stalled and behind_s >= 0.55
    assert clients[12].latest.slowest["tp[12,13,14,15]"][0] == stalled
    rows = {line.split()[0] for line in clients[0].table().splitlines()[2:] if line.strip()}
    assert {str(r) for r in range(16)} <= rows  # the hub's table, asked through a relay, has every rank's row
    for relay in relays:
        relay.close()


def test_ages_keep_running_between_forwards(tmp_path):
    hub, relays, ledgers, clients = _world(tmp_path, nodes=1, per_node=2, start=False)
    _round(relays, clients)
    _round(relays, clients)
    first = clients[0].latest.latest_age_s
    time.sleep(0.5)
    clients[0].exchange()  # served from the relay, no forward in between
    assert clients[0].latest.latest_age_s >= first + 0.45
    assert hub.calls == {"beat_node": 2}


def test_labels_held_at_the_relay_reach_the_hub_even_after_a_failed_forward(tmp_path):
    hub, relays, ledgers, clients = _world(tmp_path, nodes=1, per_node=2, start=False)
    for client in clients:
        client.exchange()  # first heartbeats, with their labels
    hub.down = True
    relays[0].forward()  # fails: the heartbeats wait
    ledgers[0].note_progress()
    clients[0].exchange()  # a newer heartbeat without labels (its client believes they were delivered)
    hub.down = False
    relays[0].forward()
    assert set(hub.state._labels[0]) == {"fence[0,1]", "tp[0,1]"}
    assert hub.state.ranks[0].beat["counts"] == {"fence[0,1]": 1, "tp[0,1]": 1}
    _round(relays, clients)
    assert set(clients[0].latest.slowest) == {"fence[0,1]", "tp[0,1]"}


def test_a_silent_hub_behind_a_relay_is_named_by_its_ranks_within_a_window(tmp_path):
    window = 1.5
    hub, relays, ledgers, clients = _world(tmp_path, nodes=1, per_node=2, start=True)
    relays[0].stale_s = 0.5
    watchdog = Watchdog(window, str(tmp_path / "node0"), 0, 2, ledger=ledgers[0], grace_s=2.0)
    time.sleep(3 * INTERVAL_S)
    hub.down = True
    down_at = time.monotonic()
    with pytest.raises(HubUnreachableError, match=r"via the relay of node n0 unreachable from rank 0") as err:
        with watchdog.phase("actor_train"):
            end = time.monotonic() + 20
            while time.monotonic() < end:
                time.sleep(0.05)
                ledgers[0].note_progress()
    assert time.monotonic() - down_at < 0.5 + window + 2 * INTERVAL_S + LOAD_SLACK_S
    assert "has not answered the relay" in str(err.value)
    watchdog.close()
    for client, relay in zip(clients, relays * 2):
        client.close()
        relay.close()


def test_a_stall_behind_relays_ends_in_a_hang_naming_the_rank(tmp_path):
    window = 1.5
    hub, relays, ledgers, clients = _world(tmp_path, nodes=2, per_node=1, start=True)
    watchdog = Watchdog(window, str(tmp_path / "node0"), 0, 2, ledger=ledgers[0], grace_s=2.0)
    waiting = ledgers[0]
    stopped = time.monotonic()
    with pytest.raises(HangError, match=r"stuck ranks=\[1\]"):
        with watchdog.phase("weight_sync/push"):
            waiting.begin_named("fence:push", "fence", (0, 1))
            end = time.monotonic() + 20
            while time.monotonic() < end:  # nobody progresses
                time.sleep(0.05)
    assert time.monotonic() - stopped < window + 4 * INTERVAL_S + LOAD_SLACK_S
    watchdog.close()
    for client, relay in zip(clients, relays):
        client.close()
        relay.close()
