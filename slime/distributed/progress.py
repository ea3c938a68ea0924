"""When did this rank, or any rank, last make progress? The clock of every no-progress deadline.

Progress is an op that completed without error (every fence and collective the ledger records), a
micro-batch, a weight bucket or checkpoint bytes written (`Ledger.note_progress`). A rank's own
progress is read from memory; its peers' only once its own has gone quiet. A rank that waits at a
fence for peers that keep working is therefore not hung; when the whole world stops, every rank's
deadline runs out one window after the last progress anywhere.

Peers' progress comes from the progress hub when the ledger has one (`ledger.hub`, set by the Ray
actor: slime/distributed/progress_hub.py), over every node and read from memory; its failure is a
HubUnreachableError within one window, never a fallback. Without a hub (a process group started
by hand) it is read from the peers' ledger files, at most once per `peer_read_s`; where that
directory is not shared between nodes, peers' files are absent and a rank sees its own progress only.
"""
from __future__ import annotations

import time

from slime.distributed.hang_report import read_ledgers, render_hang_report, suspects_from_dir
from slime.distributed.ledger import Ledger
from slime.distributed.progress_hub import HubCallError, HubClient


def latest_file_progress(ledger_dir: str | None, world_size: int) -> float:
    """The latest progress time any rank wrote to its ledger file (0 when none did)."""
    if not ledger_dir:
        return 0.0
    return max((snap.get("progress", 0.0) for snap in read_ledgers(ledger_dir, world_size).values() if snap),
               default=0.0)


class ProgressView:
    """This rank's progress from its ledger, its peers' from the hub (or their files) when its own is stale."""

    def __init__(self, ledger: Ledger | None, *, peer_read_s: float = 1.0):
        self.ledger = ledger
        self.peer_read_s = peer_read_s
        self._peers = 0.0
        self._peers_read_at = float("-inf")

    def last_progress(self, *, since: float, window_s: float, now: float | None = None) -> float:
        """The latest progress at or after `since` (the start of the wait)."""
        now = time.time() if now is None else now
        hub = self.ledger.hub if self.ledger is not None else None
        if hub is not None:
            hub.check(window_s)  # a silent hub is named, busy or not, before it can pass for quiet peers
        latest = max(since, self.ledger.progress_at if self.ledger else since)
        if now - latest <= window_s or self.ledger is None:
            return latest
        if hub is not None:
            return max(latest, hub.latest_progress(window_s))
        if not self.ledger.directory:
            return latest
        if now - self._peers_read_at >= self.peer_read_s:
            self._peers = latest_file_progress(self.ledger.directory, self.ledger.world_size)
            self._peers_read_at = now
        return max(latest, self._peers)

    def idle_s(self, *, since: float, window_s: float) -> float:
        """Seconds since the last progress of this rank or a peer (no more than `now - since`)."""
        now = time.time()
        return now - self.last_progress(since=since, window_s=window_s, now=now)


def suspects(ledger: Ledger | None, world_size: int, ledger_dir: str | None = None) -> tuple[int, ...]:
    """The ranks most waited on: judged at the hub over every node, else from the ledger files."""
    if ledger is not None and ledger.hub is not None:
        return ledger.hub.suspects()
    return suspects_from_dir(ledger_dir or (ledger.directory if ledger else None), world_size)


def hang_table(hub: HubClient | None, world_size: int, ledger_dir: str | None) -> str:
    """Where every rank is: the hub's table of every node; the ledger files here if it does not answer."""
    note = ""
    if hub is not None:
        try:
            return hub.table()
        except HubCallError as exc:
            note = f"({hub.transport.name} did not answer: {exc}; from the ledger files here:)\n"
    return note + (render_hang_report(ledger_dir, world_size) if ledger_dir else "(no ledger dir)")
