"""Self-healing runs (--max-restarts): after a named failure the driver starts the run again from its last
complete checkpoint, through the exact-resume path (docs/exact-resume.md), instead of exiting.

  named failure   a rank that raised or exited, a rank or phase past its deadline (RankWaitError), a rollout
                  that failed or timed out, an engine lost beyond --use-fault-tolerance (RolloutError,
                  TimeoutError); the session's teardown has stopped the trainer ranks, the engines and the
                  router, and given the bundles back
  restart         --load becomes --save and the run starts again at the rollout after its tracker's iteration
                  (a published checkpoint is complete: docs/exact-resume.md, "Durable and atomic")
  refused         no checkpoint within --restart-window-rollouts of the failed rollout
                  (HealingRefusedError); the same rank, or on a run of several nodes the same node, failed
                  in the restart before too (RepeatedFailureError); --max-restarts spent (the failure itself)

Each restart is one log line (cause, ranks, the checkpoint it went back to) and a `restart` metrics event
(`run/restarts`) of the restarted session.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

from slime.ray.driver.rank_wait import RankWaitError
from slime.ray.rollout_manager.errors import RolloutError

logger = logging.getLogger(__name__)

HEALABLE_ERRORS = (RankWaitError, RolloutError, TimeoutError)


class HealingRefusedError(RuntimeError):
    """A named failure that --max-restarts would heal, but there is no complete checkpoint to go back to."""


class RepeatedFailureError(RuntimeError):
    """The same rank (or node) failed in two restarts in a row: restarting again would loop."""


@dataclass(frozen=True)
class HealingPolicy:
    max_restarts: int = 0
    """Restarts allowed in one run; 0: a named failure ends the run."""
    window_rollouts: int | None = None
    """How many rollouts of work a restart may lose (None: back to any checkpoint of the run)."""

    @classmethod
    def from_args(cls, args) -> "HealingPolicy":
        return cls(max_restarts=args.max_restarts, window_rollouts=args.restart_window_rollouts)


@dataclass(frozen=True)
class Failure:
    """What ended one attempt of the run, as the driver saw it."""

    cause: str
    """The error's one line (what `training stopped:` would print)."""
    error: str
    """The error's type name."""
    rollout_id: int
    """The rollout in progress (the first rollout of the attempt when it failed at start-up)."""
    ranks: tuple[int, ...] = ()
    """The trainer ranks at fault (a fence timeout blames the ranks it found lagging; none for an engine or
    rollout failure)."""
    nodes: tuple[str, ...] = ()
    """Their nodes' addresses."""


@dataclass(frozen=True)
class Restart:
    number: int
    """1 for the run's first restart."""
    failure: Failure
    checkpoint: int
    """The iteration the restart loads: it resumes at rollout checkpoint + 1."""


def plan_restart(policy: HealingPolicy, history: tuple[Restart, ...], failure: Failure,
                 checkpoint: int | None, *, multi_node: bool) -> Restart | None:
    """The restart after `failure`, None when --max-restarts is spent (the failure ends the run), or a named
    error when a restart would not help."""
    if len(history) >= policy.max_restarts:
        return None
    if history:
        _refuse_repeat(history[-1].failure, failure, multi_node=multi_node)
    if checkpoint is None:
        raise HealingRefusedError(f"cannot restart after {failure.cause}: no complete checkpoint under --save yet "
                                  "(save earlier: a smaller --save-interval)")
    lost = failure.rollout_id - (checkpoint + 1)
    if policy.window_rollouts is not None and lost > policy.window_rollouts:
        raise HealingRefusedError(
            f"cannot restart after {failure.cause}: the last complete checkpoint is iteration {checkpoint}, "
            f"{lost} rollouts before the failed rollout {failure.rollout_id}, beyond --restart-window-rollouts "
            f"{policy.window_rollouts} (save more often, or widen the window)")
    return Restart(number=len(history) + 1, failure=failure, checkpoint=checkpoint)


def _refuse_repeat(before: Failure, now: Failure, *, multi_node: bool) -> None:
    ranks = sorted(set(before.ranks) & set(now.ranks))
    if ranks:
        raise RepeatedFailureError(f"rank(s) {ranks} failed again right after a restart ({now.cause}; before: "
                                   f"{before.cause}): stopping instead of restarting in a loop")
    nodes = sorted(set(before.nodes) & set(now.nodes))
    if multi_node and nodes:  # on one node every failure is that node's: the ranks decide
        raise RepeatedFailureError(f"node(s) {nodes} failed again right after a restart ({now.cause}; before: "
                                   f"{before.cause}): stopping instead of restarting in a loop")


def failure_of(exc: BaseException, start_rollout_id: int) -> Failure:
    """The failure the session noted on `exc` (`note_failure`), or one from the error alone."""
    return Failure(cause=str(exc).partition("\n")[0][:300], error=type(exc).__name__,
                   rollout_id=getattr(exc, "failed_rollout_id", start_rollout_id),
                   ranks=_blamed(exc), nodes=tuple(getattr(exc, "failed_nodes", ())))


def _blamed(exc: BaseException) -> tuple[int, ...]:
    """The ranks at fault: a rank whose fence timed out blames the peers it found lagging (RankWaitError.blamed)."""
    return tuple(getattr(exc, "blamed", None) or getattr(exc, "ranks", ()) or ())


def note_failure(exc: BaseException, rollout_id: int, rank_nodes: list[str]) -> None:
    """The session notes on a healable error which rollout it ended and the nodes of the ranks it names."""
    if isinstance(exc, HEALABLE_ERRORS):
        exc.failed_rollout_id = rollout_id
        exc.failed_nodes = tuple(sorted({rank_nodes[r] for r in _blamed(exc) if r < len(rank_nodes)}))


def prepare_resume(args, restart: Restart) -> None:
    """The next attempt resumes from --save's last checkpoint, as `--load <save>` would; the failed attempt's
    ledger files move aside, so that no stale verdict explains a later failure."""
    archive_ledger(args.ledger_dir, restart.number)
    args.load = args.save
    args.finetune = False  # the run's own checkpoint: optimizer, RNG and data position included
    args.start_rollout_id = None  # the session sets it from the checkpoint and checks the data position
    args.start_rollout_id_given = False
    args.restart_count = restart.number
    args.restart_checkpoint = restart.checkpoint


def archive_ledger(ledger_dir: str | None, number: int) -> None:
    """The ledger dir's files (ledgers, stacks, sequences) move to `attempt<number>/` under it; the fault-injection
    markers of tests (`fault_fired_*`) stay, so that each fires once per run."""
    if not ledger_dir or not os.path.isdir(ledger_dir):
        return
    target = os.path.join(ledger_dir, f"attempt{number}")
    os.makedirs(target, exist_ok=True)
    for name in os.listdir(ledger_dir):
        path = os.path.join(ledger_dir, name)
        if os.path.isfile(path) and not name.startswith("fault_fired_"):
            os.replace(path, os.path.join(target, name))


def train_with_healing(train: Callable[[object], None], args, *, multi_node: bool = False) -> None:
    """`train(args)`, started again from the last complete checkpoint after each named failure, within the policy."""
    from slime.checkpoint.contents import latest_iteration

    policy = HealingPolicy.from_args(args)
    history: tuple[Restart, ...] = ()
    while True:
        start = args.start_rollout_id or 0
        try:
            return train(args)
        except HEALABLE_ERRORS as exc:
            if policy.max_restarts == 0:
                raise
            failure = failure_of(exc, start)
            checkpoint = latest_iteration(args.save) if args.save else None
            restart = plan_restart(policy, history, failure, checkpoint, multi_node=multi_node)
            if restart is None:
                logger.error("--max-restarts %d spent", policy.max_restarts)
                raise
            if getattr(exc, "details", ""):
                logger.error("\n%s", exc.details)
            logger.warning("restart %d of %d: %s: %s (ranks %s, rollout %d); going back to checkpoint %d, "
                           "resuming at rollout %d", restart.number, policy.max_restarts, failure.error,
                           failure.cause, list(failure.ranks), failure.rollout_id, checkpoint, checkpoint + 1)
            history = (*history, restart)
            prepare_resume(args, restart)


def restart_metrics(args) -> dict[str, int] | None:
    """The `restart` event of a restarted session (None on the first attempt)."""
    number = args.restart_count
    if not number:
        return None
    return {"run/restarts": number, "run/restart_checkpoint": args.restart_checkpoint}
