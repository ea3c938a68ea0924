"""One deadline model for the whole loop: a wait fails when nothing has progressed for its window.

`--fence-timeout` is not how long a phase may take but how long a rank may go without progress: no
collective completing, no micro-batch, no weight bucket, no checkpoint bytes written. A healthy
phase of any length passes; a stall fails one window after the last progress. Every other limit
derives from that window:

  rank window     --fence-timeout: the watchdog's phases and the fences. Peers' progress counts (read
                  through the progress hub, from every node): a rank waiting at a fence for peers that
                  keep working is not hung. The hub sees a peer up to two heartbeat intervals (2 s) late.
  first set-up    FIRST_SETUP_WINDOWS windows per warm-up op (+ FIRST_SETUP_EXTRA_S for the phase):
                  the first communicator set-up at job start is slower than any later one.
  process groups  --distributed-timeout-minutes, strictly above every rank window (by at least
                  GROUP_TIMEOUT_MARGIN_S), so the watchdog names the phase before NCCL or gloo abort.
                  Derived when not given; checked at parse time when given.
  driver          no rank progressed for DRIVER_MARGIN windows + DRIVER_EXTRA_S (the ranks' own named
                  errors arrive first); init adds INIT_ALLOWANCE_S for model build and weight loading,
                  which are not fenced.

The driver's limits follow the ranks' progress, so they grow with --num-steps-per-rollout and with
the checkpoint size of a save without a fixed total. Rollout-side waits (generate, eval, each request)
do not come from here: they follow --rollout-timeout, or a window derived from the rollout's size
(slime/rollout/deadline.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_NO_PROGRESS_S = 600.0
FIRST_SETUP_WINDOWS = 2
FIRST_SETUP_EXTRA_S = 10.0
GROUP_TIMEOUT_MARGIN_S = 30.0
DRIVER_MARGIN = 1.5
DRIVER_EXTRA_S = 30.0
INIT_ALLOWANCE_S = 600.0


@dataclass(frozen=True, kw_only=True)
class DeadlineModel:
    """Every deadline of the loop, from --fence-timeout and --distributed-timeout-minutes."""

    no_progress_s: float = DEFAULT_NO_PROGRESS_S
    """A rank (or, seen from a fence, the whole world) that makes no progress this long is hung."""
    group_timeout_s: float | None = None
    """NCCL's and gloo's own timeout; None: derived, GROUP_TIMEOUT_MARGIN_S above the longest rank window."""

    @classmethod
    def from_args(cls, args) -> "DeadlineModel":
        minutes = getattr(args, "distributed_timeout_minutes", None)
        return cls(no_progress_s=float(getattr(args, "fence_timeout", None) or DEFAULT_NO_PROGRESS_S),
                   group_timeout_s=60.0 * float(minutes) if minutes else None)

    @property
    def first_setup_op_s(self) -> float:
        """Deadline of each communicator warm-up op at job start."""
        return FIRST_SETUP_WINDOWS * self.no_progress_s

    @property
    def first_setup_s(self) -> float:
        """The watchdog window of the first set-up phase: the longest window a rank uses."""
        return self.first_setup_op_s + FIRST_SETUP_EXTRA_S

    @property
    def group_timeout(self) -> float:
        if self.group_timeout_s is not None:
            return self.group_timeout_s
        return 60.0 * default_group_timeout_minutes(self.no_progress_s)

    @property
    def driver_window_s(self) -> float:
        """The driver fails a phase when no rank progressed for this long."""
        return DRIVER_MARGIN * self.no_progress_s + DRIVER_EXTRA_S

    @property
    def driver_init_window_s(self) -> float:
        """The same for init: model build and weight loading make no ledger progress."""
        return INIT_ALLOWANCE_S + self.first_setup_s + self.driver_window_s

    def group_timeout_error(self) -> str | None:
        """What to change when an explicit group timeout does not sit above every rank window."""
        if self.group_timeout_s is None or self.group_timeout_s >= self.first_setup_s + GROUP_TIMEOUT_MARGIN_S:
            return None
        need = default_group_timeout_minutes(self.no_progress_s)
        most = (self.group_timeout_s - GROUP_TIMEOUT_MARGIN_S - FIRST_SETUP_EXTRA_S) / FIRST_SETUP_WINDOWS
        lower = f"or lower --fence-timeout to {math.floor(most)}" if most >= 1 else "or lower --fence-timeout"
        return (f"--distributed-timeout-minutes {self.group_timeout_s / 60:g} ({self.group_timeout_s:g}s) must exceed "
                f"the ranks' longest watchdog window, {self.first_setup_s:g}s (the first communicator set-up: "
                f"{FIRST_SETUP_WINDOWS} x --fence-timeout {self.no_progress_s:g} + {FIRST_SETUP_EXTRA_S:g}s), by "
                f"{GROUP_TIMEOUT_MARGIN_S:g}s, so that the watchdog names the phase before a communicator aborts: "
                f"pass --distributed-timeout-minutes {need} (or leave it unset) {lower}")


def default_group_timeout_minutes(no_progress_s: float) -> int:
    longest = FIRST_SETUP_WINDOWS * no_progress_s + FIRST_SETUP_EXTRA_S
    return max(1, math.ceil((longest + GROUP_TIMEOUT_MARGIN_S) / 60.0))
