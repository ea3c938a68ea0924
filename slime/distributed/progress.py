"""When did this rank, or any rank, last make progress? The clock of every no-progress deadline.

Progress is an op that completed without error (every fence and collective the ledger records), a
micro-batch, a weight bucket or checkpoint bytes written (`Ledger.note_progress`). A rank's own
progress is read from memory; its peers' from their ledger files (no process group involved), only
once its own has gone quiet and at most once per `peer_read_s`. A rank that waits at a fence for
peers that keep working is therefore not hung; when the whole world stops, every rank's deadline
runs out one window after the last progress anywhere. Where the ledger directory is not shared
between nodes, peers' files are absent and each rank falls back to its own progress.
"""
from __future__ import annotations

import time

from slime.distributed.hang_report import read_ledgers
from slime.distributed.ledger import Ledger


def latest_file_progress(ledger_dir: str | None, world_size: int) -> float:
    """The latest progress time any rank wrote to its ledger file (0 when none did)."""
    if not ledger_dir:
        return 0.0
    return max((snap.get("progress", 0.0) for snap in read_ledgers(ledger_dir, world_size).values() if snap),
               default=0.0)


class ProgressView:
    """This rank's progress from its ledger, its peers' from their files when its own is stale."""

    def __init__(self, ledger: Ledger | None, *, peer_read_s: float = 1.0):
        self.ledger = ledger
        self.peer_read_s = peer_read_s
        self._peers = 0.0
        self._peers_read_at = float("-inf")

    def last_progress(self, *, since: float, window_s: float, now: float | None = None) -> float:
        """The latest progress at or after `since` (the start of the wait)."""
        now = time.time() if now is None else now
        latest = max(since, self.ledger.progress_at if self.ledger else since)
        if now - latest <= window_s or self.ledger is None or not self.ledger.directory:
            return latest
        if now - self._peers_read_at >= self.peer_read_s:
            self._peers = latest_file_progress(self.ledger.directory, self.ledger.world_size)
            self._peers_read_at = now
        return max(latest, self._peers)

    def idle_s(self, *, since: float, window_s: float) -> float:
        """Seconds since the last progress of this rank or a peer (no more than `now - since`)."""
        now = time.time()
        return now - self.last_progress(since=since, window_s=window_s, now=now)
