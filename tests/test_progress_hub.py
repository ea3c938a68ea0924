"""The progress hub: verdicts in the hub's clock, deadlines across ledgers that share no directory,
the hub's own failure as a named error, and the heartbeat's rate.

Single-process tests: the hub's state behind an in-process transport (the Ray actor forwards to the
same HubState: tests/test_progress_hub_two_nodes.py runs it on two Ray nodes), real ledgers and
watchdogs, each ledger in its own directory as on nodes that share no filesystem.
"""
from __future__ import annotations

import time

import pytest

from slime.distributed import HangError, HubUnreachableError, Ledger, Watchdog
from slime.distributed.progress_hub import HubCallError, HubClient, HubState, LocalHub, to_wire

INTERVAL_S = 0.2
# A thread on a loaded two-core machine can lose seconds to the scheduler. The upper bounds below add this
# slack and still show a stop named within the window's order, far before the 20 s each wait would run.
LOAD_SLACK_S = 5.0


class _Clock:
    def __init__(self, skew_s: float = 0.0):
        self.now = 1_000.0 + skew_s

    def __call__(self) -> float:
        return self.now


def _beat(rank: int, now: float, progress: float, seq: int, counts: dict, op: dict | None = None) -> dict:
    return to_wire({"rank": rank, "world_size": 2, "seq": seq, "phase": "actor_train", "age": now - progress,
                    "counts": counts, "recent": [], "op": op}, None)


def test_a_heartbeat_unpickles_without_torch():
    """A collective's shape is a torch.Size on the rank; the heartbeat carries it as a plain tuple, so that the hub's
    process does not import torch (seconds of CPU) to read it."""
    import pickle

    import torch

    ledger = Ledger(0, 2)
    ledger.end(ledger.begin_named("all_reduce", "tp", (0, 1), torch.Size([4, 8]), torch.float32))
    beat = ledger.heartbeat()
    assert beat["recent"][-1][2:] == [(4, 8), "float32"]
    assert b"torch" not in pickle.dumps(beat)


@pytest.mark.parametrize("skew_s", [3600.0, -3600.0])
def test_a_skewed_publisher_clock_changes_no_verdict(skew_s):
    """Rank 1's clock is an hour off; what the hub answers is what it answers without the skew."""
    verdicts = []
    for skew in (0.0, skew_s):
        hub_clock, clock0, clock1 = _Clock(), _Clock(), _Clock(skew)
        hub = HubState(2, clock=hub_clock)
        fence = {"fence[0,1]": 3}
        for step in range(5):  # rank 0 progresses every second; rank 1 stops after its first second
            for clock in (hub_clock, clock0, clock1):
                clock.now += 1.0
            hub.beat(_beat(0, clock0.now, clock0.now, 10 + step, {"fence[0,1]": 3 + step}), 0)
            if step == 0:
                hub.beat(_beat(1, clock1.now, clock1.now - 0.5, 10, fence), 1)
        hub_clock.now += 0.25
        answer = hub.beat(None, 1)
        (slowest,) = answer["slowest"]  # rank 1's one group, fence[0,1]
        verdicts.append((round(answer["latest_age"], 6), [slowest[0], round(slowest[1], 6)]))
    assert verdicts[0] == verdicts[1] == (0.25, [1, 4.75])  # rank 1 last progressed 4.75 s ago, hub clock


def test_ages_turn_into_times_on_the_reader_clock():
    hub_clock, skewed = _Clock(), _Clock(-7200.0)
    hub = HubState(1, clock=hub_clock)
    hub.beat(_beat(0, skewed.now, skewed.now - 3.0, 1, {}), 0)
    reader = HubClient(LocalHub(hub), rank=None, clock=_Clock(500.0), start=False)
    hub_clock.now += 2.0
    reader.exchange()
    assert reader.latest.latest_progress == pytest.approx(reader.clock.now - 5.0)


def _pair(tmp_path, window_s: float, *, record_hub: list | None = None):
    """Two ranks, each ledger in its own directory (nodes without a shared filesystem), one hub."""
    hub = LocalHub(HubState(2))
    ledgers, clients = [], []
    for rank in range(2):
        ledger = Ledger(rank, 2, str(tmp_path / f"node{rank}"), flush_interval_s=0.05)
        ledger.hub = HubClient(hub, ledger, interval_s=INTERVAL_S, call_timeout_s=1.0)
        ledgers.append(ledger)
        clients.append(ledger.hub)
    watchdog = Watchdog(window_s, str(tmp_path / "node0"), 0, 2, ledger=ledgers[0], grace_s=2.0)
    return hub, ledgers, clients, watchdog


def _close(ledgers, clients, watchdog) -> None:
    watchdog.close()
    for client, ledger in zip(clients, ledgers):
        client.close()
        ledger.close()


def _busy(seconds: float, tick=None) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)
        if tick is not None:
            tick()


def test_a_peer_on_another_node_keeps_a_waiting_rank_alive_and_its_stop_is_named(tmp_path):
    window = 1.5
    hub, ledgers, clients, watchdog = _pair(tmp_path, window)
    waiting, working = ledgers
    with watchdog.phase("weight_sync/push"):  # rank 0 waits at a fence rank 1 has not reached
        fence = waiting.begin_named("fence:push", "fence", (0, 1))
        _busy(4 * window, working.note_progress)  # rank 1's files are in another directory
    waiting.end(fence)
    waiting.hub = None  # control: the same wait with the files alone, where rank 1's are absent, trips
    with pytest.raises(HangError):
        with watchdog.phase("weight_sync/push"):
            waiting.end(waiting.begin_named("fence:push", "fence", (0, 1)))
            _busy(4 * window, working.note_progress)
    waiting.hub = clients[0]
    stopped = time.monotonic()
    with pytest.raises(HangError, match=r"stuck ranks=\[1\]") as err:
        with watchdog.phase("weight_sync/push"):
            waiting.begin_named("fence:push", "fence", (0, 1))
            _busy(20)  # nobody progresses any more
    assert time.monotonic() - stopped < window + 3 * INTERVAL_S + LOAD_SLACK_S, err.value
    slowest_rank, behind_s, ops = clients[0].latest.slowest["fence[0,1]"]  # rank 0's aggregate, its fence group
    assert slowest_rank == 1 and behind_s > window - 2 * INTERVAL_S and ops == 0  # as of its last answer
    assert clients[0].verdicts() == ["HANG: phase=weight_sync/push stuck ranks=[1] (reported by ranks [0])"]
    table = clients[0].table()
    assert "SUSPECT" in table and "beat age" in table
    rows = {line.split()[0]: line for line in table.splitlines()[2:4]}
    assert "SUSPECT" in rows["1"] and "fence:push" in rows["0"], table
    _close(ledgers, clients, watchdog)


def test_a_hub_that_stops_answering_is_named_within_a_window(tmp_path):
    window = 1.5
    hub, ledgers, clients, watchdog = _pair(tmp_path, window)
    with watchdog.phase("actor_train"):
        _busy(2 * window, ledgers[0].note_progress)  # answered, busy: fine
    hub.down = True
    down_at = time.monotonic()
    with pytest.raises(HubUnreachableError, match=r"local progress hub unreachable from rank 0: no answer") as err:
        with watchdog.phase("actor_train"):
            _busy(20, ledgers[0].note_progress)  # busy or not: the peers' progress is unknown now
    assert window - INTERVAL_S - 0.1 < time.monotonic() - down_at < window + INTERVAL_S + LOAD_SLACK_S
    assert "phase actor_train" in str(err.value) and "is down" in str(err.value)
    _close(ledgers, clients, watchdog)


class _SlowHub(LocalHub):
    """Answers after `delay_s`, as a hub on a loaded node does; past the call's deadline it fails as Ray's get."""

    def __init__(self, delay_s: float):
        super().__init__(HubState(1))
        self.delay_s = delay_s

    def call(self, method, *args, timeout_s):
        time.sleep(min(self.delay_s, timeout_s))
        if self.delay_s >= timeout_s:
            raise HubCallError(f"{method}: GetTimeoutError: past its {timeout_s:g}s deadline")
        return super().call(method, *args, timeout_s=timeout_s)


@pytest.mark.parametrize("delay_s", [1.2, 5.0])
def test_a_slow_answer_within_its_deadline_is_not_a_silent_hub(delay_s):
    """A window (0.5 s) shorter than one call's deadline (2 s): an answer 1.2 s late keeps the hub reachable; a
    call that passes its deadline makes it unreachable then, naming the deadline. Called unreachable while the
    answer is on the way, a loaded node's ranks would stop a healthy run."""
    window, deadline = 0.5, 2.0
    client = HubClient(_SlowHub(delay_s), rank=0, interval_s=0.05, call_timeout_s=deadline)
    begun, outcome = time.monotonic(), None
    while time.monotonic() - begun < 4.0 and outcome is None:
        try:
            client.check(window)
            if client.published or client.latest is not None:
                outcome = "answered"
        except HubUnreachableError as exc:
            outcome = exc
        time.sleep(0.05)
    client.close()
    if delay_s < deadline:
        assert outcome == "answered"
    else:
        assert isinstance(outcome, HubUnreachableError), outcome
        assert "past its 2s deadline" in str(outcome)
        assert time.monotonic() - begun >= deadline - 0.1


def test_the_heartbeat_is_sent_only_when_it_changed_at_most_once_per_interval(tmp_path):
    hub = LocalHub(HubState(1))
    ledger = Ledger(0, 1, None)
    client = HubClient(hub, ledger)  # the default interval: once a second
    start = time.monotonic()
    _busy(3.2, ledger.note_progress)
    busy_beats = client.published
    assert 2 <= busy_beats <= (time.monotonic() - start) / 1.0 + 1  # beats while busy, one a second at most
    _busy(2.5)  # quiet: asks, sends nothing
    assert client.published == busy_beats + 1  # the last change, once
    assert hub.state.ranks[0].beat["age"] < 1.5
    client.close()


def test_the_hubs_table_finds_an_op_mismatch_from_the_heartbeats_alone():
    hub = HubState(2)
    for rank, second in ((0, "all_gather_into_tensor"), (1, "reduce_scatter_tensor")):
        ledger = Ledger(rank, 2, None)  # no file anywhere
        for op in ("all_reduce", second, "all_reduce"):
            ledger.end(ledger.begin_named(op, "cp", (0, 1), (1024, 2), "float32"))
        ledger.begin_named("all_reduce", "cp", (0, 1), (8,), "float32")  # both wait in the next op
        hub.beat(to_wire(ledger.heartbeat(), None), rank)
    table = hub.table()
    assert ("op mismatch on cp[0,1] #2: rank 0 all_gather_into_tensor[1024,2], "
            "rank 1 reduce_scatter_tensor[1024,2]") in table, table


class _FailingOnce:
    """A transport whose first call fails with an error it does not promise (a bug, a library's surprise)."""

    name = "failing hub"

    def __init__(self, hub: LocalHub):
        self.hub, self.calls = hub, 0

    def call(self, method, *args, timeout_s):
        self.calls += 1
        if self.calls == 1:
            raise KeyError("slowest")
        return self.hub.call(method, *args, timeout_s=timeout_s)


def test_an_unexpected_error_in_one_exchange_leaves_the_heartbeat_thread_beating():
    transport = _FailingOnce(LocalHub(HubState(1)))
    ledger = Ledger(0, 1, None)
    client = HubClient(transport, ledger, interval_s=INTERVAL_S)
    deadline = time.monotonic() + 10
    while client.published == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.published >= 1 and transport.calls >= 2  # it went on after the failure
    assert client.last_error == "beat: KeyError: 'slowest'"
    client.close()
