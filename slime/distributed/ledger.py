"""Per-rank ledger of every fence and collective of a step, mirrored to <dir>/rank<N>.json.

The file is the channel a watchdog (or the Ray driver) reads to see where each rank is when
communicators are stuck: it never goes through a process group. A daemon thread rewrites it
(atomic replace) when something changed, so the hot path only appends in memory.

The hot path (`begin`/`end`, thousands of calls per step) is kept to a few attribute writes: each
call lands between megatron's kernel launches with cold caches, where every object it touches
costs a miss (in situ on CPU: ~50 us per collective with a dataclass, a context manager, a lock
and an Event per op; ~11 us as written now).
It takes no lock: collectives are issued by one thread at a time (the main thread, or autograd's
while the main thread waits in backward), and readers copy the containers under the GIL, taking the
copy again when an append landed between making the iterator and reading it (`_newest`).

With `record_sequence`, the same flusher also appends every op (and every fence's fields, as a
note) once to <dir>/sequence_rank<N>.jsonl: the whole sequence of the run, which
slime.distributed.order_proof compares across the members of each group. The hot path is
unchanged. The in-memory window is then trimmed by the flusher, after writing, instead of by the
deque itself, so that no op can leave memory before it is on file. The flusher then appends every
SEQUENCE_FLUSH_INTERVAL_S and still rewrites rank<N>.json at most once per flush interval.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from slime.distributed.group_names import REGISTERED, GroupIdentity, format_label, group_identity

FENCE_GROUP_NAME = "fence"
SEQUENCE_FLUSH_INTERVAL_S = 0.1  # recording the sequence: the window stays near max_entries

# One op in memory is a list (built without a Python-level __init__, mutable for end/error):
# [seq, phase, op, (group name, ranks, label), shape, dtype, start, end, error, peer]; read as LedgerEntry.
_SEQ, _PHASE, _OP, _GROUP, _SHAPE, _DTYPE, _START, _END, _ERROR, _PEER = range(10)
_now = time.time
_PROGRESS_SCAN = 8  # newest entries searched for the last completed op (one is in flight at most)
HEARTBEAT_RECENT = 8  # newest ops a heartbeat carries (the hub's table compares them across a group)


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
    peer: int | tuple | None = None
    """Global rank at the other end of a send/recv, a batch's peers in order (None: a collective, any source)."""

    @classmethod
    def from_record(cls, rec: list) -> "LedgerEntry":
        name, ranks, _ = rec[_GROUP]
        return cls(rec[_SEQ], rec[_PHASE], rec[_OP], name, ranks, tuple(rec[_SHAPE]), _dtype_text(rec[_DTYPE]),
                   rec[_START], rec[_END], rec[_ERROR], rec[_PEER])


def _dtype_text(dtype: object) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def _as_dict(rec: list) -> dict:
    return dict(vars(LedgerEntry.from_record(rec)))


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def ledger_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.json")


def sequence_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"sequence_rank{rank}.jsonl")


def _newest(entries: deque, n: int) -> list:
    """The last n records, oldest first. Making the iterator and reading it are two bytecodes, so the hot
    path's append can land in between (seen on a loaded machine: "deque mutated during iteration" ended
    the flusher thread); the copy is then taken again."""
    while True:
        try:
            return list(itertools.islice(reversed(entries), n))[::-1]
        except RuntimeError:
            continue


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
        record_sequence: bool = False,
    ):
        self.rank = rank
        self.world_size = world_size
        self.directory = directory
        self._keep_recent = keep_recent
        self._max_entries = max_entries
        recording = bool(directory and record_sequence)
        # recording: unbounded here, trimmed after each write (_append_sequence), so nothing is lost
        self._entries: deque[list] = deque(maxlen=None if recording else max_entries)
        self._phases: list[str] = []
        self._phase = "idle"  # "/".join(self._phases), kept formatted for the hot path
        self._seq = 0
        self._group_counts: dict[str, int] = {}  # ops started per group instance: peers must agree
        self._in_flight: list | None = None
        self._lock = threading.Lock()  # phase changes and snapshots; not the hot path (see module doc)
        self._flush_lock = threading.Lock()  # the flusher thread and the watchdog may both write
        self._dirty = False
        self._tick_at = _now()  # the last note_progress() (or the creation)
        self._closed = threading.Event()
        self._flusher: threading.Thread | None = None
        self._file_interval_s = flush_interval_s  # the rank's file: at most one rewrite per interval
        # recording: the sequence is appended more often, so that the window stays near max_entries
        self._tick_s = min(flush_interval_s, SEQUENCE_FLUSH_INTERVAL_S) if recording else flush_interval_s
        self._sequence = _SequenceWriter(sequence_path(directory, rank)) if recording else None
        self.hub = None  # the live link to every rank's progress (progress_hub.HubClient); None: peers' files
        if directory:
            os.makedirs(directory, exist_ok=True)
            if self._sequence:
                self._sequence.start()
            self.flush()
            self._flusher = threading.Thread(target=self._flush_loop, name=f"ledger-flush-{rank}", daemon=True)
            self._flusher.start()

    # -- phases ------------------------------------------------------------------------------
    @property
    def current_phase(self) -> str:
        return self._phase

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self._lock:
            self._phases.append(name)
            self._phase = "/".join(self._phases)
        self._dirty = True
        try:
            yield
        finally:
            with self._lock:
                self._phases.pop()
                self._phase = "/".join(self._phases) or "idle"
            self._dirty = True

    # -- ops ---------------------------------------------------------------------------------
    def begin(self, op: str, group: object | None, shape: tuple = (), dtype: object = "",
              identity: GroupIdentity | None = None, peer: int | tuple | None = None) -> list:
        """Record the start of `op` on `group`; returns the handle to pass to end(). The hot path.

        The entry is complete when it is appended: the flusher thread may write it out at once."""
        if identity is None:  # group_identity() inlined for registered groups: one call less per collective
            registered = REGISTERED.get(id(group))
            identity = registered[1] if registered is not None else group_identity(group)
        self._seq = seq = self._seq + 1
        entry = [seq, self._phase, op, identity, shape, dtype, _now(), None, None, peer]
        counts = self._group_counts
        counts[identity[2]] = counts.get(identity[2], 0) + 1
        self._entries.append(entry)
        self._in_flight = entry
        self._dirty = True
        return entry

    def begin_named(self, op: str, name: str, ranks: tuple[int, ...], shape: tuple = (), dtype: str = "") -> list:
        """begin() for a channel that is not a process group (fences, HTTP engines)."""
        return self.begin(op, None, shape, dtype, identity=(name, ranks, format_label(name, ranks)))

    def begin_p2p(self, op: str, group: object | None, shape: tuple, dtype: object, peer: int | tuple | None) -> list:
        """begin() for point-to-point ops: also records the peer(s), so that sends and receives can be paired."""
        return self.begin(op, group, shape, dtype, peer=peer)

    def note(self, kind: str, fields: dict) -> None:
        """Put `fields` (JSON-able) into the recorded sequence after the last op; nothing without record_sequence."""
        if self._sequence is not None:
            self._sequence.add_note(self._seq, self._phase, kind, fields)
            self._dirty = True

    def end(self, entry: list, error: str | None = None) -> None:
        entry[_END] = _now()
        if error is not None:
            entry[_ERROR] = error
        if self._in_flight is entry:
            self._in_flight = None
        self._dirty = True

    @property
    def waiting_in_fence(self) -> bool:
        """Whether the op in flight is a fence: its wait has its own deadline and names the lagging ranks."""
        entry = self._in_flight
        return entry is not None and entry[_END] is None and entry[_GROUP][0] == FENCE_GROUP_NAME

    def note_progress(self) -> None:
        """Progress that is not a collective (a micro-batch, a weight bucket, checkpoint bytes written)."""
        self._tick_at = _now()
        self._dirty = True

    @property
    def progress_at(self) -> float:
        """Wall-clock time of the last progress: the end of the newest op that completed without error,
        or the last note_progress(); the deadlines run from it (slime/distributed/progress.py). Read
        from the entries rather than kept by end(), which stays as cheap as it was."""
        for rec in reversed(_newest(self._entries, _PROGRESS_SCAN)):
            if rec[_END] is not None and rec[_ERROR] is None:
                return max(self._tick_at, rec[_END])
        return self._tick_at

    @contextlib.contextmanager
    def record(self, op: str, group: object | None, shape: tuple = (), dtype: str = "") -> Iterator[list]:
        entry = self.begin(op, group, shape, dtype)
        try:
            yield entry
        except BaseException as exc:
            self.end(entry, error=error_text(exc))
            raise
        self.end(entry)

    # -- reading -----------------------------------------------------------------------------
    def mark(self) -> int:
        """Sequence number to pass to signature(since=...) to look at one step only."""
        return self._seq

    def entries(self, since: int = 0) -> list[LedgerEntry]:
        return [LedgerEntry.from_record(rec) for rec in list(self._entries) if rec[_SEQ] > since]

    def signature(self, since: int = 0) -> list[tuple[str, str, str, tuple]]:
        """(phase, op, group name, shape) per op: identical on all ranks of a healthy step."""
        return [(e.phase, e.op, e.group, tuple(e.shape)) for e in self.entries(since)]

    def snapshot(self) -> dict:
        with self._lock:
            recent = _newest(self._entries, self._keep_recent)
            in_flight = self._in_flight
            # where this rank waits, or gave up waiting (a timed-out op keeps pointing at its group)
            last = recent[-1] if recent else None
            blocked = in_flight or (last if last is not None and last[_ERROR] else None)
            return {
                "rank": self.rank,
                "world_size": self.world_size,
                "pid": os.getpid(),
                "updated": time.time(),
                "phase": self.current_phase,
                "seq": self._seq,
                "progress": self.progress_at,
                "in_flight": _as_dict(in_flight) if in_flight else None,
                "blocked_on": _as_dict(blocked) if blocked else None,
                "group_counts": dict(self._group_counts),
                "recent": [_as_dict(e) for e in recent],
            }

    def heartbeat_key(self) -> tuple:
        """Changes whenever heartbeat() would say something new (not with the mere passing of time)."""
        return self._seq, self._phase, self.progress_at, self._in_flight is None

    def heartbeat(self, now: float | None = None, recent: int = HEARTBEAT_RECENT) -> dict:
        """The compact live state the progress hub keeps: ages instead of times (the hub has its own clock),
        and the newest ops as [op, group label, shape, dtype] (the label is the very string that keys
        `counts`: pickled once). Shapes go as plain tuples: a torch.Size would make the hub's process import
        torch (seconds of CPU) to unpickle the first heartbeat."""
        now = _now() if now is None else now
        newest = _newest(self._entries, recent)
        last = newest[-1] if newest else None
        op = self._in_flight or (last if last is not None and last[_ERROR] else None)
        counts = dict(self._group_counts)
        labels = {label: label for label in counts}  # a fence's label is a new string per op
        return {"rank": self.rank, "world_size": self.world_size, "seq": self._seq, "phase": self._phase,
                "age": now - self.progress_at, "counts": counts,
                "recent": [[rec[_OP], labels.get(rec[_GROUP][2], rec[_GROUP][2]), tuple(rec[_SHAPE]),
                            _dtype_text(rec[_DTYPE])] for rec in newest],
                "op": None if op is None else {"op": op[_OP], "group": op[_GROUP][0], "ranks": list(op[_GROUP][1]),
                                               "age": now - op[_START], "error": op[_ERROR]}}

    # -- file mirror -------------------------------------------------------------------------
    def flush(self) -> None:
        """Append the ops begun since the last flush to the sequence file (recording) and rewrite the rank's file."""
        if not self.directory:
            return
        with self._flush_lock:
            self._dirty = False
            if self._sequence is not None:
                self._append_sequence()
            path = ledger_path(self.directory, self.rank)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self.snapshot(), f)
            os.replace(tmp, path)

    def _append_sequence(self) -> None:
        """Write the ops begun since the last flush, then trim the window to max_entries written ops."""
        written = self._sequence.written_seq
        unwritten = self._seq - written
        if unwritten <= 0:
            self._sequence.write([], written)
            return
        take = unwritten + 1024  # slack for ops begun between reading _seq and copying
        while True:  # copy more if the step ran past the slack meanwhile
            newest = _newest(self._entries, take)
            if len(newest) < take or newest[0][_SEQ] <= written + 1:
                break
            take *= 2
        self._sequence.write([rec for rec in newest if rec[_SEQ] > written], newest[-1][_SEQ])
        entries, written = self._entries, self._sequence.written_seq
        for _ in range(len(entries) - self._max_entries):  # popleft vs the hot path's append: both atomic
            if entries[0][_SEQ] > written:
                break
            entries.popleft()

    def _flush_loop(self) -> None:
        # polls a flag rather than waiting on an Event: setting an Event per op costs the hot path a lock.
        # Recording, the ticks between two rewrites of the rank's file only append the sequence: a rewrite (a
        # JSON dump and an atomic replace) per tick cost each rank more CPU than the recording itself.
        written_at = time.monotonic()
        while not self._closed.wait(self._tick_s):
            if not self._dirty:
                continue
            if self._sequence is None or time.monotonic() - written_at >= self._file_interval_s:
                self.flush()
                written_at = time.monotonic()
            else:
                with self._flush_lock:
                    self._append_sequence()

    def close(self) -> None:
        self._closed.set()
        self.flush()


class _SequenceWriter:
    """Appends ops and notes, each once and in sequence order, to one rank's sequence file.

    Lines are JSON objects: {"seq", "pos", "phase", "op", "group", "ranks", "shape", "dtype"[, "peer"]}
    per collective or fence ("pos": 1-based position on its group), {"note", "after", "phase",
    "fields"} for fields put in by the program (fences). Runs in the flusher thread (or a caller of
    flush(), under the flush lock). Each line is formatted from cached JSON fragments: the writer
    shares the GIL with the step, so its cost per op is the recording's cost.
    """

    def __init__(self, path: str):
        self.path = path
        self.written_seq = 0
        self._positions: dict[str, int] = {}  # ops written per group label
        self._notes: list[tuple[int, str]] = []  # (seq of the op they follow, line)
        self._notes_lock = threading.Lock()
        self._fragments: dict[object, str] = {}  # phase / op / dtype / group identity -> its JSON text

    def start(self) -> None:
        open(self.path, "w").close()  # a new run's sequence, not appended to a previous one

    def add_note(self, after_seq: int, phase: str, kind: str, fields: dict) -> None:
        line = _dumps({"note": kind, "after": after_seq, "phase": phase, "fields": fields})
        with self._notes_lock:
            self._notes.append((after_seq, line))

    def write(self, records: list[list], last_seq: int) -> None:
        lines = []
        with self._notes_lock:
            notes, self._notes = self._notes, []
        pending = iter(notes)
        note = next(pending, None)
        for rec in records:
            while note is not None and note[0] < rec[_SEQ]:
                lines.append(note[1])
                note = next(pending, None)
            lines.append(self._op_line(rec))
        while note is not None and note[0] <= last_seq:
            lines.append(note[1])
            note = next(pending, None)
        if note is not None:  # follows an op not copied yet: next time
            with self._notes_lock:
                self._notes[:0] = [note, *pending]
        self.written_seq = max(self.written_seq, last_seq)
        if lines:
            with open(self.path, "a") as f:
                f.write("\n".join(lines) + "\n")

    def _fragment(self, key: object, make) -> str:
        text = self._fragments.get(key)
        if text is None:
            self._fragments[key] = text = make()
        return text

    def _op_line(self, rec: list) -> str:
        identity = rec[_GROUP]
        label = identity[2]
        self._positions[label] = position = self._positions.get(label, 0) + 1
        phase = self._fragment(("phase", rec[_PHASE]), lambda: _dumps(rec[_PHASE]))
        op = self._fragment(("op", rec[_OP]), lambda: _dumps(rec[_OP]))
        group = self._fragment(identity, lambda: f'"group":{_dumps(identity[0])},"ranks":{_dumps(list(identity[1]))}')
        dtype = self._fragment(("dtype", rec[_DTYPE]), lambda: _dumps(_dtype_text(rec[_DTYPE])))
        shape = rec[_SHAPE]
        shape = (f"[{','.join(map(str, shape))}]" if all(type(d) is int for d in shape)
                 else _dumps(_plain_shape(shape)))
        peer = "" if rec[_PEER] is None else f',"peer":{_dumps(rec[_PEER])}'
        return (f'{{"seq":{rec[_SEQ]},"pos":{position},"phase":{phase},"op":{op},{group},'
                f'"shape":{shape},"dtype":{dtype}{peer}}}')


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), default=repr)


def _plain_shape(shape) -> list:
    """Nested tuples (batched p2p: (op, shape) per transfer) as JSON lists."""
    return [_plain_shape(d) if isinstance(d, (tuple, list)) else d for d in shape]
