"""Where is each rank? Read the ledger files (no process group involved) and say who is behind."""
from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from typing import NamedTuple

from slime.distributed.group_names import format_label
from slime.distributed.ledger import ledger_path


def read_ledgers(ledger_dir: str, world_size: int) -> dict[int, dict | None]:
    """rank -> last snapshot written by that rank, or None if it never wrote one."""
    snapshots: dict[int, dict | None] = {}
    for rank in range(world_size):
        try:
            with open(ledger_path(ledger_dir, rank)) as f:
                snapshots[rank] = json.load(f)
        except (OSError, ValueError):
            snapshots[rank] = None
    return snapshots


def _members(group_key: str) -> tuple[int, ...]:
    inside = group_key[group_key.index("[") + 1 : -1] if "[" in group_key else ""
    return tuple(int(r) for r in inside.split(",") if r)


def lagging_ranks(snapshots: dict[int, dict | None]) -> tuple[int, ...]:
    """Ranks that started fewer ops on some group than a peer of that group: the ones peers wait for.

    A healthy program issues the same ops on every member of a group, so a lower count
    means the rank never reached the op its peers are blocked in. Ranks without a file lag too.
    """
    lagging = {rank for rank, snap in snapshots.items() if snap is None}
    keys = {key for snap in snapshots.values() if snap for key in snap["group_counts"]}
    for key in keys:
        members = [r for r in _members(key) if r in snapshots] or [
            r for r, s in snapshots.items() if s and key in s["group_counts"]
        ]
        counts = {r: (snapshots[r] or {}).get("group_counts", {}).get(key, 0) for r in members}
        if counts:
            top = max(counts.values())
            lagging.update(r for r, c in counts.items() if c < top)
    return tuple(sorted(lagging))


def _group_key(op: dict) -> str:
    return format_label(op["group"], op["ranks"])  # the key the ledger counts the group's ops under


def _blocked_key(snap: dict | None) -> str | None:
    op = (snap or {}).get("blocked_on")  # the ledger sets it whenever an op is in flight or gave up
    return _group_key(op) if op else None


def _signature(op: dict) -> tuple[str, str, str]:
    """What members must agree on for op #n of a group (json: a shape may be a tuple or a list)."""
    return op["op"], json.dumps(op.get("shape", []), separators=(",", ":")), op.get("dtype", "")


# a send pairs with a recv and a ring's ranks issue different batches: peers of a point-to-point
# op need not issue the same op, so only collectives can disagree
_P2P_OPS = frozenset({"isend", "irecv", "send", "recv", "batch_isend_irecv"})


class OpMismatch(NamedTuple):
    """The first position of a group at which its members' ops differ."""

    group: str
    position: int  # 1-based index of the op among the ops started on the group
    ops: dict[int, dict]  # rank -> its op at that position


def _group_ops(snap: dict, group: str) -> dict[int, dict]:
    """position on the group -> op, for this rank's recent entries on it (the newest is at group_counts)."""
    entries = [e for e in snap.get("recent", []) if _group_key(e) == group]
    last = snap["group_counts"].get(group, 0)
    return {last - i: e for i, e in enumerate(reversed(entries))}


def op_mismatches(snapshots: dict[int, dict | None]) -> list[OpMismatch]:
    """Groups whose members disagree about what op #n is. A rank that skipped op #n goes on with the
    next ops (on NCCL they return at once), so its later ops sit one position early: counts can even
    agree while the ops do not. Compared over the positions every member still has in `recent`."""
    found = []
    live = {r: s for r, s in snapshots.items() if s}
    groups = {_group_key(e) for s in live.values() for e in s.get("recent", [])}
    for group in sorted(groups):
        per_rank = {r: _group_ops(live[r], group) for r in _members(group) if r in live}
        if len(per_rank) < 2:
            continue
        common = set.intersection(*(set(ops) for ops in per_rank.values()))
        for n in sorted(common):
            at_n = [ops[n] for ops in per_rank.values()]
            if not any(op["op"] in _P2P_OPS for op in at_n) and len({_signature(op) for op in at_n}) > 1:
                found.append(OpMismatch(group, n, {r: ops[n] for r, ops in per_rank.items()}))
                break
    return found


def _skipped(rank: int, mismatch: OpMismatch, snapshots: dict[int, dict | None]) -> bool | None:
    """Do this rank's ops from the mismatch on equal a peer's from one position later (it skipped the
    peer's op #n), while the reverse does not hold? None: no overlap to compare."""
    def shifted_equal(a: dict[int, dict], b: dict[int, dict]) -> bool | None:
        pairs = [(a[n], b[n + 1]) for n in a if n >= mismatch.position and n + 1 in b]
        return all(_signature(x) == _signature(y) for x, y in pairs) if pairs else None

    mine = _group_ops(snapshots[rank], mismatch.group)
    verdicts = []
    for peer in mismatch.ops:
        if peer != rank:
            theirs = _group_ops(snapshots[peer], mismatch.group)
            verdicts.append((shifted_equal(mine, theirs), shifted_equal(theirs, mine)))
    if any(ahead is None for ahead, _ in verdicts):
        return None
    return all(ahead and not behind for ahead, behind in verdicts)


def _fits_own_history(snap: dict, mismatch: OpMismatch, rank: int) -> bool | None:
    """Did this rank's op #n follow its op #n-1 on the group before, in its recent entries?
    Layers and micro-batches repeat, so a healthy rank re-walks its own pattern. None: no precedent."""
    ops = _group_ops(snap, mismatch.group)
    before = [_signature(ops[n]) for n in sorted(ops) if n < mismatch.position]
    if not before:
        return None
    followers = {after for prev, after in zip(before, before[1:]) if prev == before[-1]}
    return _signature(mismatch.ops[rank]) in followers if followers else None


def _deviating_ranks(mismatch: OpMismatch, snapshots: dict[int, dict | None]) -> tuple[int, ...]:
    """The minority against a majority op; on a tie, the rank whose later ops show it skipped one, or
    whose op breaks its own pattern while every other one fits it; otherwise all of them (a fair list
    beats a wrong single name)."""
    signatures = {rank: _signature(op) for rank, op in mismatch.ops.items()}
    (top, top_n), (_, second_n) = Counter(signatures.values()).most_common(2)
    if top_n > second_n:
        return tuple(r for r, sig in signatures.items() if sig != top)
    skipped = tuple(r for r in mismatch.ops if _skipped(r, mismatch, snapshots))
    if len(skipped) == 1:
        return skipped
    fits = {rank: _fits_own_history(snapshots[rank], mismatch, rank) for rank in mismatch.ops}
    off = tuple(r for r, ok in fits.items() if ok is False)
    if off and all(ok for r, ok in fits.items() if r not in off):
        return off
    return tuple(mismatch.ops)


def _most_waited_on(snapshots: dict[int, dict | None]) -> tuple[int, ...]:
    """Every rank blocked in (or timed out of) an op of group G votes for each member of G that has
    started fewer ops on G; the ranks with the most votes.

    Separates the culprit from its victims in a symmetric deadlock (a rank that skipped an op waits in
    the next op, for peers that wait for it in the skipped one: it collects the most votes).
    """
    votes: Counter[int] = Counter()
    for rank, snap in snapshots.items():
        key = _blocked_key(snap)
        if key is None:
            continue
        for peer in _members(key):
            peer_snap = snapshots.get(peer)
            if peer_snap is None or peer_snap["group_counts"].get(key, 0) < snap["group_counts"][key]:
                votes[peer] += 1
    top = max(votes.values(), default=0)
    return tuple(sorted(r for r, v in votes.items() if v == top))


def suspect_ranks(snapshots: dict[int, dict | None]) -> tuple[int, ...]:
    """Who to blame: ranks that deviated in an op mismatch (the most direct evidence), else the ranks
    most waited on, else lagging_ranks when no rank is visibly blocked."""
    deviating = {r for mismatch in op_mismatches(snapshots) for r in _deviating_ranks(mismatch, snapshots)}
    return tuple(sorted(deviating)) or _most_waited_on(snapshots) or lagging_ranks(snapshots)


def _describe(mismatch: OpMismatch) -> str:
    signatures = {rank: _signature(op) for rank, op in mismatch.ops.items()}
    show_dtype = len({dtype for _, _, dtype in signatures.values()}) > 1
    ops = ", ".join(f"rank {r} {op}{shape}" + (f" {dtype}" if show_dtype else "")
                    for r, (op, shape, dtype) in signatures.items())
    return f"op mismatch on {mismatch.group} #{mismatch.position}: {ops}"


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# The table's columns, explained in the README ("Reading a hang table").
COLUMNS = ["rank", "verdict", "phase", "op", "group", "waiting", "progress", "seq", "file age"]


def _verdict(rank: int, snap: dict | None, suspects: tuple[int, ...]) -> str:
    """One word per rank: SUSPECT (the ranks to blame), waiting (inside an op, on its peers),
    working (outside any collective: computing, or between calls), absent (no ledger file)."""
    if rank in suspects:
        return "SUSPECT"
    if snap is None:
        return "absent"
    return "waiting" if snap.get("in_flight") or snap.get("blocked_on") else "working"


def _age(now: float, then: float | None) -> str:
    return f"{now - then:.1f}s" if then else "?"


def _row(rank: int, snap: dict | None, now: float, suspects: tuple[int, ...], missing: str) -> list[object]:
    verdict = _verdict(rank, snap, suspects)
    if snap is None:
        return [rank, verdict, missing, "", "", "", "", "", ""]
    op = snap.get("in_flight") or snap.get("blocked_on")
    what = [op["op"], _group_key(op), _age(now, op["start"]) + (" (gave up)" if op.get("error") else "")] if op \
        else ["<not in a collective>", "", ""]
    return [rank, verdict, snap["phase"], *what, _age(now, snap.get("progress")), snap["seq"],
            _age(now, snap["updated"])]


def render_hang_report(ledger_dir: str, world_size: int) -> str:
    """The table (COLUMNS) plus the first op mismatch per group and the ranks behind and blamed.

    Safe to call from the Ray driver or another shell while the run is stuck: it only reads files.
    """
    return render_snapshots(read_ledgers(ledger_dir, world_size), time.time())


def render_snapshots(snapshots: dict[int, dict | None], now: float, *, age_column: str = "file age",
                     missing: str = "<no ledger file>") -> str:
    """The same from snapshots in hand (the progress hub's, whose times are on its clock: `now` too)."""
    suspects = suspect_ranks(snapshots)
    rows = [_row(rank, snap, now, suspects, missing) for rank, snap in sorted(snapshots.items())]
    mismatches = "".join(f"\n{_describe(m)}" for m in op_mismatches(snapshots))
    return (
        f"{format_table([*COLUMNS[:-1], age_column], rows)}{mismatches}\nranks behind a peer on some group: "
        f"{list(lagging_ranks(snapshots))}; most waited-on (suspects): {list(suspects)}"
    )


def summarize_hang(ledger_dir: str, world_size: int) -> str:
    """One line from the ledger files: the phases ranks were last in and the ranks most waited on."""
    snapshots = read_ledgers(ledger_dir, world_size)
    phases = sorted({snap["phase"] for snap in snapshots.values() if snap})
    return f"ledgers: phase={','.join(phases) or '?'} suspects={list(suspect_ranks(snapshots))}"


def suspects_from_dir(ledger_dir: str | None, world_size: int) -> tuple[int, ...]:
    if not ledger_dir or not os.path.isdir(ledger_dir):
        return ()
    return suspect_ranks(read_ledgers(ledger_dir, world_size))


def ledger_world_size(ledger_dir: str) -> int:
    """The world size the rank files of a directory were written for (0: no rank file)."""
    sizes = []
    for name in os.listdir(ledger_dir):
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(ledger_dir, name)) as f:
                    sizes.append(int(json.load(f)["world_size"]))
            except (OSError, ValueError, KeyError):
                continue
    return max(sizes, default=0)


def watchdog_verdicts(ledger_dir: str) -> list[str]:
    """The HANG lines watchdogs left (first line of each stacks file), ranks reporting the same verdict
    merged: "HANG: phase=<p> stuck ranks=[3] (reported by ranks [0, 1, 2])"."""
    lines = {}
    for name in sorted(os.listdir(ledger_dir)):
        match = re.fullmatch(r"stacks_rank(\d+)\.txt", name)
        if match:
            with open(os.path.join(ledger_dir, name)) as f:
                lines[int(match.group(1))] = f.readline()
    return merge_verdicts(lines)


def merge_verdicts(lines: dict[int, str]) -> list[str]:
    """rank -> its watchdog's HANG line, as one line per verdict with the ranks that reported it."""
    reporters: dict[str, list[int]] = {}
    for rank, line in sorted(lines.items()):
        verdict = line.strip().split(" (rank ", 1)[0]
        if verdict:
            reporters.setdefault(verdict, []).append(rank)
    return [f"{verdict} (reported by ranks {sorted(ranks)})" for verdict, ranks in reporters.items()]


def main(argv: list[str] | None = None) -> int:
    """`python -m slime.distributed.hang_report DIR`: the table of a run, live, from another shell."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m slime.distributed.hang_report",
                                     description="Where is every rank of a (seemingly stuck) run? Reads the "
                                                 "ledger files under DIR (--ledger-dir; printed at start).")
    parser.add_argument("ledger_dir", metavar="DIR")
    parser.add_argument("--world-size", type=int, default=None, help="ranks to show (default: from the files)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.ledger_dir):
        parser.error(f"{args.ledger_dir} is not a directory; pass the ledger directory the run printed at start")
    world_size = args.world_size or ledger_world_size(args.ledger_dir)
    if not world_size:
        parser.error(f"no rank<N>.json under {args.ledger_dir}: the ranks have not started, or pass --world-size")
    from slime.distributed.roles import role_dirs

    roles = role_dirs(args.ledger_dir)
    for role, path in roles:  # the actor's ranks, then the critic's (<DIR>/critic) when the run has one
        if len(roles) > 1:
            print(f"{role} ranks:")
        print(render_hang_report(path, world_size if path == args.ledger_dir else ledger_world_size(path)))
        for line in watchdog_verdicts(path):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
