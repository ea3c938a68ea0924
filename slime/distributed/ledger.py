"""Per-rank ledger of every fence and collective of a step, mirrored to <dir>/rank<N>.json.

The file is the channel a watchdog (or the Ray driver) reads to see where each rank is when
communicators are stuck: it never goes through a process group. A daemon thread rewrites it
(atomic replace) whenever something changed, so the hot path only appends in memory.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from slime.distributed.group_names import group_name, group_ranks

FENCE_GROUP_NAME = "fence"


@dataclass
class LedgerEntry:
    seq: int
    phase: str
    op: str
    group: str
    ranks: tuple[int, ...]
    shape: tuple
    dtype: str
    start: float
    end: float | None = None
    error: str | None = None


def _as_dict(entry: LedgerEntry) -> dict:
    return dict(vars(entry))  # fields are flat: no need for asdict's deep copy under the lock


def ledger_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.json")


class Ledger:
    """Records (phase, seq, op, group, shape, dtype, start/end) for one rank."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        directory: str | None = None,
        *,
        keep_recent: int = 32,
        flush_interval_s: float = 0.5,
        max_entries: int = 50_000,
    ):
        self.rank = rank
        self.world_size = world_size
        self.directory = directory
        self._keep_recent = keep_recent
        self._entries: deque[LedgerEntry] = deque(maxlen=max_entries)
        self._phases: list[str] = []
        self._seq = 0
        self._group_counts: dict[str, int] = {}  # ops started per group instance: peers must agree
        self._group_keys: dict[tuple[str, tuple[int, ...]], str] = {}
        self._in_flight: LedgerEntry | None = None
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # the flusher thread and the watchdog may both write
        self._dirty = threading.Event()
        self._closed = False
        self._flusher: threading.Thread | None = None
        self._flush_interval_s = flush_interval_s
        if directory:
            os.makedirs(directory, exist_ok=True)
            self.flush()
            self._flusher = threading.Thread(target=self._flush_loop, name=f"ledger-flush-{rank}", daemon=True)
            self._flusher.start()

    # -- phases ------------------------------------------------------------------------------
    @property
    def current_phase(self) -> str:
        return "/".join(self._phases) or "idle"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self._lock:
            self._phases.append(name)
        self._dirty.set()
        try:
            yield
        finally:
            with self._lock:
                self._phases.pop()
            self._dirty.set()

    # -- ops ---------------------------------------------------------------------------------
    def begin(self, op: str, group: object | None, shape: tuple = (), dtype: str = "") -> LedgerEntry:
        name, ranks = group_name(group), group_ranks(group)
        return self.begin_named(op, name, ranks, shape, dtype)

    def begin_named(self, op: str, name: str, ranks: tuple[int, ...], shape: tuple = (), dtype: str = "") -> LedgerEntry:
        key = self._group_keys.get((name, ranks))
        if key is None:  # the hot path (thousands of ops per step) reuses the formatted key
            key = self._group_keys[(name, ranks)] = f"{name}[{','.join(map(str, ranks))}]"
        with self._lock:
            self._seq += 1
            entry = LedgerEntry(self._seq, self.current_phase, op, name, ranks, shape, dtype, time.time())
            self._group_counts[key] = self._group_counts.get(key, 0) + 1
            self._entries.append(entry)
            self._in_flight = entry
        self._mark_dirty()
        return entry

    def end(self, entry: LedgerEntry, error: str | None = None) -> None:
        with self._lock:
            entry.end = time.time()
            entry.error = error
            if self._in_flight is entry:
                self._in_flight = None
        self._mark_dirty()

    def _mark_dirty(self) -> None:
        if not self._dirty.is_set():  # Event.set takes a lock and notifies: skip it when already set
            self._dirty.set()

    @contextlib.contextmanager
    def record(self, op: str, group: object | None, shape: tuple = (), dtype: str = "") -> Iterator[LedgerEntry]:
        entry = self.begin(op, group, shape, dtype)
        try:
            yield entry
        except BaseException as exc:
            self.end(entry, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            raise
        self.end(entry)

    # -- reading -----------------------------------------------------------------------------
    def mark(self) -> int:
        """Sequence number to pass to signature(since=...) to look at one step only."""
        return self._seq

    def entries(self, since: int = 0) -> list[LedgerEntry]:
        with self._lock:
            return [e for e in self._entries if e.seq > since]

    def signature(self, since: int = 0) -> list[tuple[str, str, str, tuple]]:
        """(phase, op, group name, shape) per op: identical on all ranks of a healthy step."""
        return [(e.phase, e.op, e.group, tuple(e.shape)) for e in self.entries(since)]

    def snapshot(self) -> dict:
        with self._lock:
            recent = list(self._entries)[-self._keep_recent :]
            # where this rank waits, or gave up waiting (a timed-out op keeps pointing at its group)
            last = self._entries[-1] if self._entries else None
            blocked = self._in_flight or (last if last is not None and last.error else None)
            return {
                "rank": self.rank,
                "world_size": self.world_size,
                "pid": os.getpid(),
                "updated": time.time(),
                "phase": self.current_phase,
                "seq": self._seq,
                "in_flight": _as_dict(self._in_flight) if self._in_flight else None,
                "blocked_on": _as_dict(blocked) if blocked else None,
                "group_counts": dict(self._group_counts),
                "recent": [_as_dict(e) for e in recent],
            }

    # -- file mirror -------------------------------------------------------------------------
    def flush(self) -> None:
        if not self.directory:
            return
        with self._flush_lock:
            self._dirty.clear()
            path = ledger_path(self.directory, self.rank)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self.snapshot(), f)
            os.replace(tmp, path)

    def _flush_loop(self) -> None:
        while not self._closed:
            if self._dirty.wait(timeout=1.0) and not self._closed:
                self.flush()
                time.sleep(self._flush_interval_s)  # coalesce bursts of ops into one write (GIL time off the step)

    def close(self) -> None:
        self._closed = True
        self._dirty.set()
        self.flush()
