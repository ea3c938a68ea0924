"""Every rank's live progress through one hub the driver starts: no shared filesystem, no N-file reads.

Each rank's `HubClient` thread sends, at most once per `interval_s` and only when it changed, a
compact heartbeat of its ledger (`Ledger.heartbeat`: phase, sequence number, the op it is blocked
in, ops per group, and how long ago its last progress was) and gets back one aggregate: how long
ago anyone made progress, and per group of the rank its slowest member. With nothing new to send it
only asks, so every rank makes one call per interval whatever it does, and the hub answers N calls
a second. Deadlines read the last aggregate from memory (slime/distributed/progress.py).

Clocks: a heartbeat carries ages measured on the rank's own clock, the hub turns them into times on
its clock at receipt, and the aggregate goes back as ages again, placed on the rank's clock at the
middle of the call. No time is ever compared across two machines, so a skewed node changes no
verdict (only transit time enters, bounded by the call's deadline).

The hub is a Ray actor on the driver's node (`start_hub`): it takes no CPU slot, joins no process
group and is never called from the step's own thread. Every call has a deadline (`call_timeout_s`)
and each client keeps at most MAX_PENDING_CALLS in flight. A rank that has heard nothing from the
hub for a whole window raises HubUnreachableError naming the hub and itself: the hub's failure is
never taken for the peers' silence, and never silently replaced by a weaker rule.

At thousands of ranks, one relay per node (slime/distributed/progress_relay.py) forwards its ranks'
heartbeats in one call per interval (`beat_node`), so the hub hears one caller per node.

The ledger files stay the durable record (`python -m slime.distributed.hang_report DIR`); the live
table of every node is rendered at the hub (`HubClient.table`).
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from slime.distributed.errors import HubUnreachableError
from slime.utils.deadlines import HUB_CALL_S

DEFAULT_INTERVAL_S = 1.0
MAX_PENDING_CALLS = 4  # per client: a hub that stopped answering does not pile up calls
AGGREGATE_REFRESH_S = 0.2  # the per-group answer is recomputed at most this often (N calls a second)


class HubCallError(RuntimeError):
    """One call to the hub failed or passed its deadline (the client retries until its window runs out)."""


class HubTransport(Protocol):
    name: str

    def call(self, method: str, *args: Any, timeout_s: float) -> Any: ...


# -- the hub ---------------------------------------------------------------------------------------
def _members(label: str) -> tuple[int, ...]:
    inside = label[label.index("[") + 1:-1] if "[" in label else ""
    return tuple(int(r) for r in inside.split(",") if r)


def to_wire(beat: dict, labels_sent: list[str] | None) -> dict:
    """A heartbeat for the wire: group labels (thousands of characters on a large world) only when the
    set changed since `labels_sent`, else counts and recent ops by position in the labels."""
    labels = list(beat["counts"])
    where = {label: i for i, label in enumerate(labels)}
    wire = {**beat, "counts": [beat["counts"][label] for label in labels],
            "recent": [[op, where[label], shape, dtype] for op, label, shape, dtype in beat["recent"]]}
    if labels != labels_sent:
        wire["labels"] = labels
    return wire


@dataclass
class _Rank:
    received: float  # hub clock
    progress: float  # hub clock
    beat: dict
    op_start: float | None  # hub clock


@dataclass
class HubState:
    """What the hub knows, in its own clock. Pure logic: the Ray actor only forwards to it."""

    world_size: int
    clock: Callable[[], float] = time.time
    ranks: dict[int, _Rank] = field(default_factory=dict)
    _latest: float | None = None
    _slowest: dict[str, tuple[float, list]] = field(default_factory=dict)  # label -> (computed at, answer)
    _members: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _labels: dict[int, list[str]] = field(default_factory=dict)  # rank -> the group labels it last sent
    verdict_lines: dict[int, str] = field(default_factory=dict)  # rank -> its watchdog's HANG line

    def __post_init__(self) -> None:
        self.started = self.clock()  # ranks that never sent count as progressing at the hub's start

    def beat(self, heartbeat: dict | None, rank: int | None) -> dict:
        """Keep `heartbeat` (to_wire's form; None: nothing new), answer the aggregate for `rank` (None: the driver)."""
        now = self.clock()
        if heartbeat is not None:
            self._keep(heartbeat, now)
        return self.aggregate(rank, now)

    def beat_node(self, heartbeats: list[dict], ranks: list[int]) -> list[dict]:
        """A node relay's call (slime/distributed/progress_relay.py): keep its ranks' heartbeats, answer
        the aggregate of each of `ranks`."""
        now = self.clock()
        for heartbeat in heartbeats:
            self._keep(heartbeat, now)
        return [self.aggregate(rank, now) for rank in ranks]

    def _keep(self, wire: dict, now: float) -> None:
        if wire.get("labels"):  # one copy of each label however many ranks send it (a world's is long)
            wire = {**wire, "labels": [sys.intern(label) for label in wire["labels"]]}
        labels = self._labels[wire["rank"]] = wire.get("labels") or self._labels.get(wire["rank"], [])
        beat = {**wire, "counts": dict(zip(labels, wire["counts"])),
                "recent": [[op, labels[i], shape, dtype] for op, i, shape, dtype in wire["recent"]]}
        progress = now - beat["age"]
        previous = self.ranks.get(beat["rank"])
        if previous is not None and beat["seq"] >= previous.beat["seq"]:
            progress = max(progress, previous.progress)  # transit jitter never moves progress back
        op = beat.get("op")
        self.ranks[beat["rank"]] = _Rank(now, progress, beat, now - op["age"] if op else None)
        self._latest = progress if self._latest is None else max(self._latest, progress)

    def aggregate(self, rank: int | None, now: float | None = None) -> dict:
        now = self.clock() if now is None else now
        groups = self._labels.get(rank, []) if rank is not None else []
        return {"latest_age": None if self._latest is None else now - self._latest,
                "slowest": [self._slowest_member(label, now) for label in groups]}  # by position in the labels

    def _slowest_member(self, label: str, now: float) -> list:
        """[rank, seconds since its progress, ops it started on the group] of the member furthest behind:
        the fewest ops started on the group (the one its peers wait for), then the oldest progress."""
        cached = self._slowest.get(label)
        if cached is not None and now - cached[0] < AGGREGATE_REFRESH_S:
            age_then = cached[1]
            return [age_then[0], age_then[1] + (now - cached[0]), age_then[2]]
        members = self._group_members(label)
        slowest = min(members or (), key=lambda r: (self._count(r, label), self._progress_of(r)), default=None)
        answer = [slowest, now - self._progress_of(slowest), self._count(slowest, label)] if slowest is not None \
            else [None, 0.0, 0]
        self._slowest[label] = (now, answer)
        return answer

    def _group_members(self, label: str) -> tuple[int, ...]:
        members = self._members.get(label)
        if members is None:
            members = self._members[label] = _members(label)
        return members

    def _progress_of(self, rank: int) -> float:
        known = self.ranks.get(rank)
        return known.progress if known else self.started

    def _count(self, rank: int, label: str) -> int:
        known = self.ranks.get(rank)
        return known.beat.get("counts", {}).get(label, 0) if known else 0

    def snapshots(self) -> dict[int, dict | None]:
        """rank -> a ledger snapshot (hang_report's format, times on the hub's clock; no recent ops)."""
        return {rank: self._snapshot(self.ranks.get(rank)) for rank in range(self.world_size)}

    def _snapshot(self, known: _Rank | None) -> dict | None:
        if known is None:
            return None
        beat, op = known.beat, known.beat.get("op")
        entry = None
        if op:
            entry = {"seq": beat["seq"], "phase": beat["phase"], "op": op["op"], "group": op["group"],
                     "ranks": op["ranks"], "shape": [], "dtype": "", "start": known.op_start, "end": None,
                     "error": op.get("error"), "peer": None}
        recent = [{"op": name, "group": label.partition("[")[0], "ranks": list(self._group_members(label)),
                   "shape": shape, "dtype": dtype} for name, label, shape, dtype in beat.get("recent", [])]
        return {"rank": beat["rank"], "world_size": beat.get("world_size", self.world_size), "updated": known.received,
                "phase": beat["phase"], "seq": beat["seq"], "progress": known.progress,
                "in_flight": entry if op and not op.get("error") else None, "blocked_on": entry,
                "group_counts": dict(beat.get("counts", {})), "recent": recent}

    def table(self) -> str:
        from slime.distributed.hang_report import render_snapshots  # only at a stall: the hub stays light

        return render_snapshots(self.snapshots(), self.clock(), age_column="beat age", missing="<no heartbeat>")

    def suspects(self) -> tuple[int, ...]:
        from slime.distributed.hang_report import suspect_ranks

        return suspect_ranks(self.snapshots())

    def report(self, rank: int, line: str) -> None:
        self.verdict_lines[rank] = line

    def verdicts(self) -> list[str]:
        from slime.distributed.hang_report import merge_verdicts

        return merge_verdicts(self.verdict_lines)


class ProgressHub:
    """The Ray actor: one HubState, calls served one at a time (no lock needed)."""

    def __init__(self, world_size: int):
        self.state = HubState(world_size)
        self.calls = 0

    def beat(self, heartbeat: dict | None, rank: int | None) -> dict:
        self.calls += 1
        return self.state.beat(heartbeat, rank)

    def beat_node(self, heartbeats: list[dict], ranks: list[int]) -> list[dict]:
        self.calls += 1
        return self.state.beat_node(heartbeats, ranks)

    def table(self) -> str:
        return self.state.table()

    def suspects(self) -> tuple[int, ...]:
        return self.state.suspects()

    def report(self, rank: int, line: str) -> None:
        self.state.report(rank, line)

    def verdicts(self) -> list[str]:
        return self.state.verdicts()

    def stats(self) -> dict:
        return {"cpu_s": time.process_time(), "calls": self.calls, "ranks": len(self.state.ranks)}


def run_every(interval_s: float, step: Callable[[], None], closed: threading.Event,
              on_error: Callable[[Exception], None]) -> None:
    """A heartbeat thread's loop: `step` once per interval until `closed`. An error `step` did not expect goes to
    `on_error` and the loop goes on: a thread that ended would read as a silent hub to whoever waits on it."""
    while not closed.is_set():
        begun = time.monotonic()
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - see the docstring
            on_error(exc)
        closed.wait(max(0.0, interval_s - (time.monotonic() - begun)))


def start_hub(world_size: int, runtime_env: dict | None = None, *, max_pending_calls: int = MAX_PENDING_CALLS):
    """Start the hub on this (the driver's) node, taking no CPU slot; returns (actor handle, name for errors).

    No restarts: a new hub would know no rank, and ranks must not take its silence for theirs.
    `max_pending_calls` counts per process (one rank each; a benchmark's process holds many)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    handle = ray.remote(ProgressHub).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        max_restarts=0, max_pending_calls=max_pending_calls, runtime_env=runtime_env).remote(world_size)
    return handle, f"progress hub (Ray actor {handle._actor_id.hex()[:12]} on node {node[:12]})"


class RayHub:
    """The transport to the hub actor: each call is a `ray.get` with its deadline."""

    def __init__(self, handle, name: str):
        self.handle = handle
        self.name = name

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        import ray

        try:
            return ray.get(getattr(self.handle, method).remote(*args), timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as exc:  # dead, overloaded, or over the deadline
            raise HubCallError(f"{method}: {type(exc).__name__}: {str(exc)[:200]}") from exc


class LocalHub:
    """A HubState in this process behind the transport interface (single-process tests, benchmarks)."""

    def __init__(self, state: HubState, name: str = "local progress hub"):
        self.state = state
        self.name = name
        self.down = False
        self._lock = threading.Lock()

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        if self.down:
            raise HubCallError(f"{method}: {self.name} is down")
        with self._lock:
            return getattr(self.state, method)(*args)


# -- a rank's (or the driver's) side ----------------------------------------------------------------
@dataclass(frozen=True)
class Aggregate:
    """The hub's answer, placed on this process's clock."""

    received_at: float  # this clock, the middle of the call
    latest_age_s: float | None  # seconds before received_at that some rank last progressed (None: none yet)
    slowest: dict[str, list]  # group label -> [rank, seconds since its progress, ops it started on the group]

    @property
    def latest_progress(self) -> float:
        return 0.0 if self.latest_age_s is None else self.received_at - self.latest_age_s


class HubClient:
    """One process's link to the hub: a daemon thread exchanges once per interval; readers never wait.

    `ledger` None: the driver (asks only). `clock` (default: the wall clock, read at each call) is
    the clock the readers of `latest` compare with; contact is timed on the monotonic clock.
    """

    def __init__(self, transport: HubTransport, ledger=None, *, rank: int | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S, call_timeout_s: float = HUB_CALL_S,
                 clock: Callable[[], float] | None = None, start: bool = True):
        self.transport = transport
        self.ledger = ledger
        self.rank = rank if rank is not None else getattr(ledger, "rank", None)
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self.clock = clock or (lambda: time.time())
        self.latest: Aggregate | None = None
        self.published = 0  # heartbeats the hub acknowledged
        self.last_error = ""
        self._sent_key: tuple | None = None
        self._labels_sent: list[str] | None = None
        self._contact = time.monotonic()  # the last answer (or the start)
        self._asking_since: float | None = None  # when the call in flight began (None: none in flight)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"progress-hub-{self.rank}", daemon=True)
        if start:
            self._thread.start()

    @property
    def who(self) -> str:
        return "the driver" if self.rank is None else f"rank {self.rank}"

    def _loop(self) -> None:
        run_every(self.interval_s, self.exchange, self._closed, self._note_error)

    def _note_error(self, exc: Exception) -> None:
        self.last_error = f"beat: {type(exc).__name__}: {str(exc)[:200]}"

    def exchange(self) -> None:
        """Send the heartbeat if it changed (else only ask); keep the answer. Never raises."""
        key = self.ledger.heartbeat_key() if self.ledger is not None else None
        beat = None
        if key is not None and key != self._sent_key:
            beat = to_wire(self.ledger.heartbeat(), self._labels_sent)
        sent = self.clock()
        self._asking_since = time.monotonic()
        try:
            answer = self.transport.call("beat", beat, self.rank, timeout_s=self.call_timeout_s)
        except HubCallError as exc:
            self.last_error = str(exc)
            return
        finally:
            self._asking_since = None
        received = self.clock()
        self._contact = time.monotonic()
        if beat is not None:
            self._sent_key = key
            self._labels_sent = beat.get("labels", self._labels_sent)  # what the hub holds for this rank
            self.published += 1
        slowest = dict(zip(self._labels_sent or [], answer["slowest"]))
        self.latest = Aggregate((sent + received) / 2, answer["latest_age"], slowest)

    def check(self, window_s: float) -> None:
        """HubUnreachableError once the hub has not answered for `window_s`; while a call is in flight, for
        `window_s` plus one call's deadline: a window shorter than a call's deadline would otherwise call a slow
        hub (a loaded node) unreachable while its answer is on the way. A hub that fails calls is named at the
        window."""
        silent = time.monotonic() - self._contact
        limit = window_s if self._asking_since is None else window_s + self.call_timeout_s
        if silent > limit:
            raise HubUnreachableError(
                f"{self.transport.name} unreachable from {self.who}: no answer for {silent:.0f}s "
                f"(window {window_s:g}s; calls time out after {self.call_timeout_s:g}s); last error: "
                f"{self.last_error or 'none'}", hub=self.transport.name, rank=self.rank)

    def latest_progress(self, window_s: float) -> float:
        """The latest progress of any rank, on this clock (0: none known); raises when the hub is gone."""
        self.check(window_s)
        return self.latest.latest_progress if self.latest else 0.0

    def suspects(self) -> tuple[int, ...]:
        """The ranks most waited on, judged at the hub over every rank; () when it does not answer."""
        try:
            return tuple(self.transport.call("suspects", timeout_s=self.call_timeout_s))
        except HubCallError:
            return ()

    def table(self) -> str:
        """The hang table of every rank on every node (hang_report's columns), rendered at the hub;
        HubCallError when it does not answer (slime.distributed.progress.hang_table falls back to files)."""
        return self.transport.call("table", timeout_s=self.call_timeout_s)

    def report(self, line: str) -> None:
        """Leave this rank's watchdog verdict at the hub (the driver names why a rank process ended)."""
        try:
            self.transport.call("report", self.rank, line, timeout_s=self.call_timeout_s)
        except HubCallError:
            pass  # the stacks file keeps it on this node

    def verdicts(self) -> list[str]:
        """The watchdog verdicts every node's ranks reported, merged (hang_report.merge_verdicts)."""
        try:
            return self.transport.call("verdicts", timeout_s=self.call_timeout_s)
        except HubCallError:
            return []

    def close(self) -> None:
        self._closed.set()
