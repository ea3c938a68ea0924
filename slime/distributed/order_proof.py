"""The order proof: every member of every group recorded the same sequence of collectives.

    python -m slime.distributed.order_proof LEDGER_DIR [--incomplete]

Reads the sequence files a run wrote with `--ledger-record-sequence` (one per rank, see ledger.py)
and checks, for every process group instance (a name and its global ranks, e.g. cp[1,3,5,7]):

- collectives and fences: every member recorded the same list of (op, shape, dtype), in order;
- all-to-alls (expert parallelism): besides the same (op, row shape, dtype) in order, the k-th one's
  token counts pair up: the rows member a sends to member b are the rows b receives from a;
- point-to-point ops: ring and pipeline peers post sends and receives in different orders and
  directions by design, so they are paired instead: for each ordered pair a -> b of members, the
  (shape, dtype) of a's sends to b equal those of b's receives from a, in order (which is how
  NCCL and gloo match them).

A run that ended cleanly is checked as complete: a member with more or fewer ops than its peers
fails. A run that failed (`--incomplete`) stopped at different points on different ranks, so
only the part every member reached is compared; an op that differs there still fails, and the
rank that deviated is named. Exit status: 0 when the proof holds, 1 when it does not.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass

from slime.distributed.group_names import format_label
from slime.distributed.roles import role_dirs

_P2P_SEND = frozenset({"isend", "send"})
_P2P_RECV = frozenset({"irecv", "recv"})
P2P_OPS = _P2P_SEND | _P2P_RECV | {"batch_isend_irecv"}
_RANK_FILE = re.compile(r"sequence_rank(\d+)\.jsonl$")


@dataclass(frozen=True, kw_only=True)
class SequenceOp:
    """One recorded op of one rank."""

    seq: int
    position: int
    """1-based index among the ops this rank started on the group."""
    phase: str
    op: str
    group: str
    ranks: tuple[int, ...]
    shape: tuple
    dtype: str
    peer: int | tuple | None = None
    """The peer of a send/recv; a batch's peers, one per transfer."""

    @property
    def label(self) -> str:
        return format_label(self.group, self.ranks)

    @property
    def signature(self) -> tuple[str, str, str]:
        """What every member must agree on: op, shape, dtype (shape as JSON: nested lists compare)."""
        return self.op, json.dumps(self.shape, separators=(",", ":")), self.dtype

    def describe(self) -> str:
        return f"{self.op}{list(self.shape)} {self.dtype}"


@dataclass(frozen=True)
class SequenceNote:
    """Fields a fence put into the sequence (e.g. the plan every rank claimed)."""

    kind: str
    after_seq: int
    phase: str
    fields: dict


@dataclass(frozen=True)
class RankSequence:
    rank: int
    ops: tuple[SequenceOp, ...]
    notes: tuple[SequenceNote, ...]


def _deep_tuple(value):
    return tuple(_deep_tuple(v) for v in value) if isinstance(value, list) else value


def read_sequence(path: str, rank: int) -> RankSequence:
    ops, notes = [], []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            if "op" in record:
                ops.append(SequenceOp(seq=record["seq"], position=record["pos"], phase=record["phase"],
                                      op=record["op"], group=record["group"], ranks=tuple(record["ranks"]),
                                      shape=_deep_tuple(record["shape"]), dtype=record["dtype"],
                                      peer=_deep_tuple(record.get("peer"))))
            elif "note" in record:
                notes.append(SequenceNote(record["note"], record["after"], record["phase"], record["fields"]))
    return RankSequence(rank, tuple(ops), tuple(notes))


def read_sequences(directory: str) -> dict[int, RankSequence]:
    """rank -> its recorded sequence, for every sequence_rank<N>.jsonl in the directory."""
    found = {}
    for path in glob.glob(os.path.join(directory, "sequence_rank*.jsonl")):
        match = _RANK_FILE.search(path)
        if match:
            found[int(match.group(1))] = read_sequence(path, int(match.group(1)))
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class OrderMismatch:
    group: str
    position: int
    """1-based index among the group's collectives (or its pair's transfers) where members differ."""
    ranks: tuple[int, ...]
    """The ranks that deviate from their peers."""
    detail: str

    def format(self) -> str:
        return f"{self.group} #{self.position}: {self.detail}; deviating ranks {list(self.ranks)}"


@dataclass(frozen=True)
class OrderReport:
    ranks: int
    groups: int
    ops: int
    mismatches: tuple[OrderMismatch, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def format(self) -> str:
        head = f"order proof: {self.groups} groups, {self.ops} ops on {self.ranks} ranks: "
        if self.ok:
            return head + "every member of every group recorded the same sequence"
        return head + f"{len(self.mismatches)} mismatches\n" + "\n".join(m.format() for m in self.mismatches)


def check_order(sequences: dict[int, RankSequence], *, complete: bool = True) -> OrderReport:
    """Compare, group by group, what the members recorded (module docstring)."""
    mismatches = [OrderMismatch("<sequence>", seq, (rank,), f"rank {rank}'s sequence misses ops before #{seq}")
                  for rank, sequence in sequences.items() for seq in _missing(sequence)]
    by_group = _ops_by_group(sequences)
    for label, (members, per_rank) in sorted(by_group.items()):
        missing = [r for r in members if r not in sequences]
        if missing:
            mismatches.append(OrderMismatch(label, 0, tuple(missing), "no sequence file for these members"))
            continue
        collectives = {r: [op for op in per_rank.get(r, []) if op.op not in P2P_OPS] for r in members}
        mismatches += _compare_collectives(label, collectives, complete)
        mismatches += _compare_all_to_all(label, members, collectives)
        mismatches += _compare_transfers(label, members, per_rank, complete)
    ops = sum(len(s.ops) for s in sequences.values())
    return OrderReport(len(sequences), len(by_group), ops, tuple(mismatches))


def _missing(sequence: RankSequence) -> list[int]:
    """Sequence numbers after a hole (a file cut short or edited): the proof needs every op."""
    expected = [1] + [op.seq + 1 for op in sequence.ops[:-1]]
    return [op.seq for op, seq in zip(sequence.ops, expected) if op.seq != seq]


def _ops_by_group(sequences: dict[int, RankSequence]) -> dict[str, tuple[tuple[int, ...], dict[int, list[SequenceOp]]]]:
    groups: dict[str, tuple[tuple[int, ...], dict[int, list[SequenceOp]]]] = {}
    for rank, sequence in sequences.items():
        for op in sequence.ops:
            members, per_rank = groups.setdefault(op.label, (op.ranks or (rank,), {}))
            per_rank.setdefault(rank, []).append(op)
    return groups


def _compare_collectives(label: str, per_rank: dict[int, list[SequenceOp]], complete: bool) -> list[OrderMismatch]:
    """The first position where members' (op, shape, dtype) differ; then, if complete, the lengths."""
    lengths = {r: len(ops) for r, ops in per_rank.items()}
    for index in range(min(lengths.values(), default=0)):
        at = {r: ops[index] for r, ops in per_rank.items()}
        if len({op.signature for op in at.values()}) > 1:
            ops = ", ".join(f"rank {r} {op.describe()} ({op.phase})" for r, op in at.items())
            return [OrderMismatch(label, index + 1, _deviating(per_rank, index), f"members differ: {ops}")]
    if complete and len(set(lengths.values())) > 1:
        top = max(lengths.values())
        short = tuple(r for r, n in lengths.items() if n < top)
        counts = ", ".join(f"rank {r} {n}" for r, n in lengths.items())
        return [OrderMismatch(label, min(lengths.values()) + 1, short,
                              f"members recorded different numbers of collectives: {counts}")]
    return []


def _compare_all_to_all(label: str, members: tuple[int, ...], per_rank: dict[int, list[SequenceOp]]
                        ) -> list[OrderMismatch]:
    """The k-th all-to-all of a group: rows a sends to b (its splits) == rows b receives from a."""
    calls = {r: [op for op in ops if op.op == "all_to_all_single" and op.peer] for r, ops in per_rank.items()}
    for index in range(min((len(c) for c in calls.values()), default=0)):
        at = {r: c[index] for r, c in calls.items()}
        for a, b in ((a, b) for a in members for b in members if a in at and b in at):
            sent, received = at[a].peer[1][members.index(b)], at[b].peer[2][members.index(a)]
            if sent != received:
                return [OrderMismatch(label, at[a].position, (a, b),
                                      f"all-to-all #{index + 1} ({at[a].phase}): rank {a} sends {sent} rows to "
                                      f"rank {b}, which expects {received}")]
    return []


def _deviating(per_rank: dict[int, list[SequenceOp]], index: int) -> tuple[int, ...]:
    """The minority against a majority op; on a tie, the rank whose later ops are its peers' shifted by one
    (it skipped their op); otherwise every member."""
    signatures = {r: ops[index].signature for r, ops in per_rank.items()}
    ranked = Counter(signatures.values()).most_common()
    if len(ranked) > 1 and ranked[0][1] > ranked[1][1]:
        return tuple(r for r, sig in signatures.items() if sig != ranked[0][0])
    skipped = [r for r, ops in per_rank.items() if _skipped_one(ops, per_rank, r, index)]
    return tuple(skipped) if len(skipped) == 1 else tuple(per_rank)


def _skipped_one(ops: list[SequenceOp], per_rank: dict[int, list[SequenceOp]], rank: int, index: int) -> bool:
    def shifted(mine: list[SequenceOp], theirs: list[SequenceOp]) -> bool:
        pairs = list(zip(mine[index:], theirs[index + 1:]))
        return bool(pairs) and all(a.signature == b.signature for a, b in pairs)

    return all(shifted(ops, other) and not shifted(other, ops) for r, other in per_rank.items() if r != rank)


def _compare_transfers(label: str, members: tuple[int, ...], per_rank: dict[int, list[SequenceOp]],
                       complete: bool) -> list[OrderMismatch]:
    """Per ordered pair a -> b: a's sends to b against b's receives from a."""
    sends: dict[tuple[int, int], list[tuple]] = {}
    recvs: dict[tuple[int, int], list[tuple]] = {}
    unpaired = []
    for rank in members:
        for op in per_rank.get(rank, []):
            for direction, peer, shape in _transfers(op):
                if peer is None:
                    unpaired.append(OrderMismatch(label, op.position, (rank,),
                                                  f"rank {rank} {op.op} from any source cannot be paired"))
                    continue
                book = sends if direction == "send" else recvs
                book.setdefault((rank, peer) if direction == "send" else (peer, rank), []).append((shape, op.dtype))
    found = unpaired
    for pair in sorted(set(sends) | set(recvs)):
        sent, received = sends.get(pair, []), recvs.get(pair, [])
        differ = next((i for i, (s, r) in enumerate(zip(sent, received)) if s != r), None)
        a, b = pair
        if differ is not None:
            found.append(OrderMismatch(label, differ + 1, pair, f"rank {a} sends {sent[differ]} to rank {b}, "
                                       f"which receives {received[differ]}"))
        elif complete and len(sent) != len(received):
            found.append(OrderMismatch(label, min(len(sent), len(received)) + 1,
                                       (a,) if len(sent) < len(received) else (b,),
                                       f"rank {a} sends {len(sent)} transfers to rank {b}, "
                                       f"which receives {len(received)}"))
    return found


def _transfers(op: SequenceOp) -> list[tuple[str, int | None, tuple]]:
    """(send|recv, peer, shape) of each transfer of a point-to-point op (a batch holds several)."""
    if op.op in _P2P_SEND:
        return [("send", op.peer, op.shape)]
    if op.op in _P2P_RECV:
        return [("recv", op.peer, op.shape)]
    if op.op == "batch_isend_irecv":
        return [("send" if name in _P2P_SEND else "recv", peer, tuple(shape))
                for (name, shape), peer in zip(op.shape, op.peer or (None,) * len(op.shape))]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ledger_dir", help="the --ledger-dir of a run made with --ledger-record-sequence")
    parser.add_argument("--incomplete", action="store_true",
                        help="the run failed: compare only what every member of a group reached")
    args = parser.parse_args(argv)
    roles = [(role, read_sequences(path)) for role, path in role_dirs(args.ledger_dir)]
    if not roles[0][1]:
        parser.error(f"no sequence_rank<N>.jsonl in {args.ledger_dir!r}: run train.py with "
                     "--ledger-record-sequence --ledger-dir DIR")
    ok = True
    for role, sequences in roles:  # each role's ranks have their own groups (the critic's: <DIR>/critic)
        report = check_order(sequences, complete=not args.incomplete)
        print(report.format() if len(roles) == 1 else f"{role}: {report.format()}")
        ok = ok and report.ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
