"""Self-healing runs (--max-restarts): after a named failure the driver starts the run again from its last
complete checkpoint, through the exact-resume path (docs/exact-resume.md), instead of exiting.

  named failure   a rank that raised or exited, a rank or phase past its deadline (RankWaitError), a rollout
                  that failed or timed out, an engine lost beyond --use-fault-tolerance (RolloutError,
                  TimeoutError); the session's teardown has stopped the trainer ranks and, unless they alone
                  failed (`trainer_side`: the engines then keep serving for the next session, session.py),
                  the engines and the router, and given the bundles back
  restart         --load becomes --save and the run starts again at the rollout after its tracker's iteration
                  (a published checkpoint is complete: docs/exact-resume.md, "Durable and atomic"), with
                  the optimizer and RNG of that checkpoint whatever --no-load-optim / --no-load-rng said
  refused         no checkpoint of this run's own (HealingRefusedError: none yet, one another run wrote, or
                  one from after the failed rollout), or none within --restart-window-rollouts of the failed
                  rollout; the same rank of the same role, or on a run of several nodes the same node, failed
                  in the restart before too (RepeatedFailureError); --max-restarts spent (the failure itself)

A checkpoint is this run's when its manifest names the run's id (`args.run_id`, written by every save) or it
is the one the run started from (--load is --save): `slime.checkpoint.contents.heal_target`.
Each restart is one log line (cause, ranks, the checkpoint it went back to), a `restart` metrics event
(`run/restarts`) of the restarted session, and a `healed` event (`run/heal_s`) once its first rollout is done.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from slime.config.health import HealingPolicy
from slime.config.run_config import run_config_of
from slime.config.run_state import advance, run_state_of
from slime.ray.driver.rank_wait import RankWaitError
from slime.ray.rollout_manager.errors import RolloutError

logger = logging.getLogger(__name__)

HEALABLE_ERRORS = (RankWaitError, RolloutError, TimeoutError)
ENGINE_FACING_PHASES = ("weight_sync",)
"""Trainer phases that talk to the engines: a failure there may leave an engine mid-update."""


class HealingRefusedError(RuntimeError):
    """A named failure that --max-restarts would heal, but there is no complete checkpoint of this run to go back
    to."""


class RepeatedFailureError(RuntimeError):
    """The same rank (or node) failed in two restarts in a row: restarting again would loop."""


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
    role: str = ""
    """Whose ranks `ranks` numbers: "actor" or "critic" (each role numbers its ranks from 0); "" for the rollout
    side."""


@dataclass(frozen=True)
class SavedCheckpoint:
    """The checkpoint --save's tracker names, as a restart sees it."""

    iteration: int
    own: bool
    """Written by this run, or the one it started from (`slime.checkpoint.contents.heal_target`)."""
    written_by: str | None = None
    """The run id in its manifest (None: saved before manifests named their run)."""


@dataclass(frozen=True)
class Restart:
    number: int
    """1 for the run's first restart."""
    failure: Failure
    checkpoint: int
    """The iteration the restart loads: it resumes at rollout checkpoint + 1."""
    detected_at: float = 0.0
    """time.monotonic() when the driver caught the failure (the heal's time is measured from it)."""


def plan_restart(policy: HealingPolicy, history: tuple[Restart, ...], failure: Failure,
                 checkpoint: SavedCheckpoint | None, *, multi_node: bool) -> Restart | None:
    """The restart after `failure`, None when --max-restarts is spent (the failure ends the run), or a named
    error when a restart would not help."""
    if len(history) >= policy.max_restarts:
        return None
    if history:
        _refuse_repeat(history[-1].failure, failure, multi_node=multi_node)
    if checkpoint is None:
        raise HealingRefusedError(f"cannot restart after {failure.cause}: no complete checkpoint under --save yet "
                                  "(save earlier: a smaller --save-interval)")
    _refuse_foreign(checkpoint, failure)
    lost = failure.rollout_id - (checkpoint.iteration + 1)
    if policy.window_rollouts is not None and lost > policy.window_rollouts:
        raise HealingRefusedError(
            f"cannot restart after {failure.cause}: the last complete checkpoint is iteration {checkpoint.iteration}, "
            f"{lost} rollouts before the failed rollout {failure.rollout_id}, beyond --restart-window-rollouts "
            f"{policy.window_rollouts} (save more often, or widen the window)")
    return Restart(number=len(history) + 1, failure=failure, checkpoint=checkpoint.iteration)


def _refuse_foreign(checkpoint: SavedCheckpoint, failure: Failure) -> None:
    """A restart goes back only to a checkpoint this run wrote (or started from): another run's would continue
    with its weights, optimizer and data position."""
    if not checkpoint.own:
        writer = f"run {checkpoint.written_by}" if checkpoint.written_by else "a run that did not record its id"
        raise HealingRefusedError(
            f"cannot restart after {failure.cause}: --save's tracker names iteration {checkpoint.iteration}, which "
            f"{writer} saved, not this run (this run has saved no checkpoint yet; a restart would continue another "
            "run's weights and data position): save earlier (a smaller --save-interval), or give the run a --save "
            "directory of its own")
    if checkpoint.iteration > failure.rollout_id:
        raise HealingRefusedError(
            f"cannot restart after {failure.cause}: --save's tracker names iteration {checkpoint.iteration}, after "
            f"the failed rollout {failure.rollout_id}: it is not this run's; give the run a --save directory of its "
            "own")


def _refuse_repeat(before: Failure, now: Failure, *, multi_node: bool) -> None:
    ranks = sorted(set(before.ranks) & set(now.ranks)) if before.role == now.role else []
    if ranks:
        raise RepeatedFailureError(f"{now.role or 'trainer'} rank(s) {ranks} failed again right after a restart "
                                   f"({now.cause}; before: {before.cause}): stopping instead of restarting in a loop")
    nodes = sorted(set(before.nodes) & set(now.nodes))
    if multi_node and nodes:  # on one node every failure is that node's: the ranks decide
        raise RepeatedFailureError(f"node(s) {nodes} failed again right after a restart ({now.cause}; before: "
                                   f"{before.cause}): stopping instead of restarting in a loop")


def failure_of(exc: BaseException, start_rollout_id: int) -> Failure:
    """The failure the session noted on `exc` (`note_failure`), or one from the error alone."""
    return Failure(cause=str(exc).partition("\n")[0][:300], error=type(exc).__name__,
                   rollout_id=getattr(exc, "failed_rollout_id", start_rollout_id),
                   ranks=_blamed(exc), nodes=tuple(getattr(exc, "failed_nodes", ())), role=getattr(exc, "role", ""))


def _blamed(exc: BaseException) -> tuple[int, ...]:
    """The ranks at fault: a rank whose fence timed out blames the peers it found lagging (RankWaitError.blamed)."""
    return tuple(getattr(exc, "blamed", None) or getattr(exc, "ranks", ()) or ())


def note_failure(exc: BaseException, rollout_id: int, rank_nodes: Mapping[str, Sequence[str]]) -> None:
    """The session notes on a healable error which rollout it ended and the nodes of the ranks it names (each
    role's ranks on that role's nodes: `rank_nodes` by role)."""
    if isinstance(exc, HEALABLE_ERRORS):
        exc.failed_rollout_id = rollout_id
        nodes = rank_nodes.get(getattr(exc, "role", ""), ())
        exc.failed_nodes = tuple(sorted({nodes[r] for r in _blamed(exc) if r < len(nodes)}))


def trainer_side(exc: BaseException) -> bool:
    """A failure of the trainer ranks alone (not while they pushed weights): the engines are not involved, so a
    restart may keep them serving."""
    return isinstance(exc, RankWaitError) and exc.phase not in ENGINE_FACING_PHASES


def resume_args(args, restart: Restart):
    """The next attempt's arguments: it resumes from --save's last checkpoint, as `--load <save>` would, with
    everything the checkpoint holds (--no-load-optim and --no-load-rng were the first attempt's: a restart that kept
    them would not continue the run); the failed attempt's ledger files move aside, so that no stale verdict explains
    a later failure. A new namespace: the failed attempt's stays as it was."""
    from slime.config.critic_role import critic_save_dir

    archive_ledger(run_state_of(args).ledger_dir, restart.number)
    flags = {"load": args.save, "finetune": False,  # the run's own checkpoint: optimizer, RNG and data position
             "no_load_optim": False, "no_load_rng": False}
    if args.use_critic:  # the critic's own saves (--critic-save, else <save>/critic), not the --critic-load it began at
        flags["critic_load"] = critic_save_dir(args)
    resumed = type(args)(**{**vars(args), **flags})
    advance(resumed, start_rollout_id=None,  # the session sets it from the checkpoint and checks the data position
            start_rollout_id_given=False, restart_count=restart.number, restart_checkpoint=restart.checkpoint,
            restart_detected_at=restart.detected_at)
    return resumed


KEPT_IN_LEDGER = ("engine-logs",)
"""What a restart leaves in place in the ledger dir: the logs of engines that may still be serving."""


def archive_ledger(ledger_dir: str | None, number: int) -> None:
    """The ledger dir's files and the critic's (ledgers, stacks, sequences) move to `attempt<number>/` under it;
    the fault-injection markers of tests (`fault_fired_*`) stay, so that each fires once per run, and so do the
    earlier attempts and the engines' logs."""
    if not ledger_dir or not os.path.isdir(ledger_dir):
        return
    target = os.path.join(ledger_dir, f"attempt{number}")
    os.makedirs(target, exist_ok=True)
    for name in os.listdir(ledger_dir):
        path = os.path.join(ledger_dir, name)
        if name.startswith(("fault_fired_", "attempt")) or name in KEPT_IN_LEDGER:
            continue
        if os.path.isdir(path):
            shutil.move(path, os.path.join(target, name))
        elif os.path.isfile(path):
            os.replace(path, os.path.join(target, name))


def resumed_from(args) -> int | None:
    """The checkpoint the run starts from when it is --save's own (--load is --save): a restart may go back to
    it before the run saved one of its own."""
    from slime.checkpoint.contents import latest_iteration

    if not (args.load and args.save) or args.finetune or not _same_directory(args.load, args.save):
        return None
    return latest_iteration(args.save)


def _same_directory(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def saved_checkpoint(save: str | None, run_id: str, started_from: int | None) -> SavedCheckpoint | None:
    """What --save's tracker names, and whether this run may go back to it (None: no tracker)."""
    from slime.checkpoint.contents import heal_target, latest_iteration, written_by

    latest = latest_iteration(save) if save else None
    if latest is None:
        return None
    return SavedCheckpoint(iteration=latest, own=heal_target(save, run_id, started_from) == latest,
                           written_by=written_by(save, latest))


def train_with_healing(train: Callable[[object], None], args, *, multi_node: bool = False) -> None:
    """`train(args)`, started again from the last complete checkpoint after each named failure, within the policy."""
    policy = run_config_of(args).healing
    started_from = resumed_from(args)
    history: tuple[Restart, ...] = ()
    while True:
        start = run_state_of(args).start_rollout_id  # a restart's session reads it from the checkpoint
        if start is None:
            start = history[-1].checkpoint + 1 if history else 0
        try:
            return train(args)
        except HEALABLE_ERRORS as exc:
            detected_at = time.monotonic()
            if policy.max_restarts == 0:
                raise
            failure = failure_of(exc, start)
            checkpoint = saved_checkpoint(args.save, args.run_id, started_from)
            restart = plan_restart(policy, history, failure, checkpoint, multi_node=multi_node)
            if restart is None:
                logger.error("--max-restarts %d spent", policy.max_restarts)
                raise
            restart = Restart(restart.number, restart.failure, restart.checkpoint, detected_at)
            if getattr(exc, "details", ""):
                logger.error("\n%s", exc.details)
            logger.warning("restart %d of %d: %s: %s (%sranks %s, rollout %d); going back to checkpoint %d, "
                           "resuming at rollout %d", restart.number, policy.max_restarts, failure.error,
                           failure.cause, f"{failure.role} " if failure.role else "", list(failure.ranks),
                           failure.rollout_id, restart.checkpoint, restart.checkpoint + 1)
            history = (*history, restart)
            args = resume_args(args, restart)


def restart_metrics(args) -> dict[str, int] | None:
    """The `restart` event of a restarted session (None on the first attempt)."""
    state = run_state_of(args)
    if not state.restart_count:
        return None
    return {"run/restarts": state.restart_count, "run/restart_checkpoint": state.restart_checkpoint}


def heal_metrics(args, engines_kept: bool) -> dict[str, float] | None:
    """The `healed` event, once the first rollout of a restarted session is done (None on the first attempt):
    seconds from the failure's detection to that rollout trained, saved and pushed."""
    state = run_state_of(args)
    if not state.restart_count:
        return None
    return {"run/heal_s": time.monotonic() - state.restart_detected_at, "run/engines_kept": int(engines_kept)}
