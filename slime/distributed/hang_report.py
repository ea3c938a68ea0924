"""Where is each rank? Read the ledger files (no process group involved) and say who is behind."""
from __future__ import annotations

import json
import os
import time
from collections import Counter

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


def _blocked_key(snap: dict | None) -> str | None:
    op = (snap or {}).get("blocked_on")
    return f"{op['group']}[{','.join(map(str, op['ranks']))}]" if op else None


def suspect_ranks(snapshots: dict[int, dict | None]) -> tuple[int, ...]:
    """The ranks most waited on: every rank blocked in (or timed out of) an op of group G votes for each
    member of G that has started fewer ops on G.

    Separates the culprit from its victims in a symmetric deadlock (a rank that skipped an op waits in
    the next op, for peers that wait for it in the skipped one: it collects the most votes).
    Falls back to lagging_ranks when no rank is visibly blocked.
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
    if not votes:
        return lagging_ranks(snapshots)
    top = max(votes.values())
    return tuple(sorted(r for r, v in votes.items() if v == top))


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _row(rank: int, snap: dict | None, now: float) -> list[object]:
    if snap is None:
        return [rank, "<no ledger file>", "", "", "", "", ""]
    op = snap.get("in_flight") or snap.get("blocked_on")
    if op:
        group = f"{op['group']}[{','.join(map(str, op['ranks']))}]"
        waited = f"{now - op['start']:.1f}s" + (" (gave up)" if op.get("error") else "")
        return [rank, snap["phase"], op["op"], group, waited, snap["seq"], f"{now - snap['updated']:.1f}s"]
    return [rank, snap["phase"], "<not in a collective>", "", "", snap["seq"], f"{now - snap['updated']:.1f}s"]


def render_hang_report(ledger_dir: str, world_size: int) -> str:
    """A table (rank, phase, op, group, waiting since, seq, file age) plus the lagging ranks.

    Safe to call from the Ray driver after its own ray.get timeout: it only reads files.
    """
    snapshots = read_ledgers(ledger_dir, world_size)
    now = time.time()
    rows = [_row(rank, snap, now) for rank, snap in sorted(snapshots.items())]
    table = format_table(["rank", "phase", "op", "group", "waiting", "seq", "file age"], rows)
    return (
        f"{table}\nranks behind a peer on some group: {list(lagging_ranks(snapshots))}; "
        f"most waited-on (suspects): {list(suspect_ranks(snapshots))}"
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
