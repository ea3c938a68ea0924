"""One relay per node between its ranks and the progress hub: the hub hears one caller per node, not per rank.

At 8,192 ranks the hub would answer 8,192 calls a second; through relays (8 ranks a node) it answers
1,024, each carrying the node's new heartbeats and asking the aggregate of each of its ranks
(`HubState.beat_node`). A rank's `HubClient` talks to its node's relay exactly as to the hub (the
same `HubTransport` interface): its heartbeat waits there for the next forward (the newest per rank
wins; group labels are never lost between two forwards) and it gets back the last aggregate the hub
sent for it, its ages advanced by the time since, so a quiet rank still reads the true age of its
peers' progress. Every heartbeat keeps its rank: the hub's verdicts and table still name the rank.

The relay never stands in for a silent hub: once the hub has not answered for `stale_s`, its ranks'
calls fail too (HubCallError), so each rank's HubUnreachableError comes one window later as without
a relay. Other calls (table, suspects, report, verdicts) go straight through to the hub.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any

from slime.distributed.progress_hub import DEFAULT_INTERVAL_S, HubCallError, HubTransport, run_every
from slime.utils.deadlines import HUB_CALL_S


class NodeRelay:
    """A `HubTransport` for the ranks of one node, forwarding to the hub's transport once per interval."""

    def __init__(self, hub: HubTransport, node: str, *, interval_s: float = DEFAULT_INTERVAL_S,
                 call_timeout_s: float = HUB_CALL_S, stale_s: float | None = None,
                 start: bool = True):
        self.hub = hub
        self.name = f"{hub.name} via the relay of node {node}"
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self.stale_s = stale_s if stale_s is not None else call_timeout_s + 2 * interval_s
        self.forwards = 0  # calls to the hub that answered
        self.last_error = ""
        self._lock = threading.Lock()
        self._pending: dict[int, dict] = {}  # rank -> its newest heartbeat not yet at the hub
        self._askers: set[int] = set()  # local ranks (None: a driver on this node asks the hub itself)
        self._answers: dict[int, tuple[dict, float]] = {}  # rank -> (aggregate, monotonic time it was current)
        self._contact = time.monotonic()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"progress-relay-{node}", daemon=True)
        if start:
            self._thread.start()

    # -- the ranks' side ---------------------------------------------------------------------------
    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        if method != "beat":
            return self.hub.call(method, *args, timeout_s=timeout_s)
        heartbeat, rank = args
        if rank is None:
            return self.hub.call(method, *args, timeout_s=timeout_s)
        silent = time.monotonic() - self._contact
        if silent > self.stale_s:
            raise HubCallError(f"beat: {self.name}: the hub has not answered the relay for {silent:.0f}s "
                               f"(last error: {self.last_error or 'none'})")
        with self._lock:
            self._askers.add(rank)
            if heartbeat is not None:
                self._hold(rank, heartbeat)
            return self._answer(rank)

    def _hold(self, rank: int, heartbeat: dict) -> None:
        waiting = self._pending.get(rank)
        if "labels" in heartbeat:
            heartbeat = {**heartbeat, "labels": [sys.intern(label) for label in heartbeat["labels"]]}
            self._answers.pop(rank, None)  # its answer's positions follow the labels the hub held
        elif waiting is not None and "labels" in waiting:
            heartbeat = {**heartbeat, "labels": waiting["labels"]}  # the hub has not got them yet
        self._pending[rank] = heartbeat

    def _answer(self, rank: int) -> dict:
        known = self._answers.get(rank)
        if known is None:
            return {"latest_age": None, "slowest": []}
        answer, at = known
        later = time.monotonic() - at
        return {"latest_age": None if answer["latest_age"] is None else answer["latest_age"] + later,
                "slowest": [[r, age + later, count] for r, age, count in answer["slowest"]]}

    # -- the hub's side ----------------------------------------------------------------------------
    def _loop(self) -> None:
        run_every(self.interval_s, self.forward, self._closed, self._note_error)

    def _note_error(self, exc: Exception) -> None:
        self.last_error = f"beat_node: {type(exc).__name__}: {str(exc)[:200]}"

    def forward(self) -> None:
        """Send the held heartbeats, keep every local rank's answer. Never raises; on failure they wait."""
        with self._lock:
            pending, self._pending = self._pending, {}
            ranks = sorted(self._askers)
        if not ranks:
            return
        sent = time.monotonic()
        try:
            answers = self.hub.call("beat_node", list(pending.values()), ranks, timeout_s=self.call_timeout_s)
        except HubCallError as exc:
            self.last_error = str(exc)
            with self._lock:  # newer heartbeats win; labels still owed to the hub stay
                for rank, heartbeat in pending.items():
                    newer = self._pending.get(rank)
                    if newer is None:
                        self._pending[rank] = heartbeat
                    elif "labels" not in newer and "labels" in heartbeat:
                        self._pending[rank] = {**newer, "labels": heartbeat["labels"]}
            return
        now = time.monotonic()
        at = (sent + now) / 2  # the hub computed the ages about the middle of the call
        with self._lock:
            for rank, answer in zip(ranks, answers):
                if rank not in self._pending or "labels" not in self._pending[rank]:
                    self._answers[rank] = (answer, at)
        self._contact = now
        self.forwards += 1

    def close(self) -> None:
        self._closed.set()


# -- on Ray: one relay actor per node, shared by the node's ranks ------------------------------------
RELAY_MIN_WORLD = 512  # below this the hub answers every rank itself (1,024 direct callers: ~40% of a core)


class RelayActor:
    """The Ray actor of a node's relay: the hub's methods, forwarded through one NodeRelay."""

    def __init__(self, hub_handle, hub_name: str, node: str):
        from slime.distributed.progress_hub import RayHub

        self.relay = NodeRelay(RayHub(hub_handle, hub_name), node[:12])

    def _call(self, method: str, *args: Any) -> Any:
        return self.relay.call(method, *args, timeout_s=self.relay.call_timeout_s)

    def beat(self, heartbeat: dict | None, rank: int | None) -> dict:
        return self._call("beat", heartbeat, rank)

    def table(self) -> str:
        return self._call("table")

    def suspects(self) -> tuple[int, ...]:
        return self._call("suspects")

    def report(self, rank: int, line: str) -> None:
        self._call("report", rank, line)

    def verdicts(self) -> list[str]:
        return self._call("verdicts")


def node_relay(hub: tuple, *, runtime_env: dict | None = None) -> tuple:
    """(handle, name) of this node's relay in front of `hub` (the hub's (handle, name)), started by the
    first rank of the node that asks. It lives as long as that rank's process (a run ends with any rank's)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    hub_handle, hub_name = hub
    node = ray.get_runtime_context().get_node_id()
    handle = ray.remote(RelayActor).options(
        name=f"progress-relay-{hub_handle._actor_id.hex()[:12]}-{node[:12]}", get_if_exists=True, num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False), max_restarts=0,
        max_concurrency=4, runtime_env=runtime_env).remote(hub_handle, hub_name, node)
    return handle, f"{hub_name} via the relay of node {node[:12]}"
