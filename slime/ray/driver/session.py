"""The run session: what train.py and train_async.py share around their loop.

Set-up, in this order (each slow step is one start-up line on stdout):

  resume position   --start-rollout-id, else the rollout after --load's last checkpoint (its saved data
                    position is checked before Ray starts)
  ledger dir        --ledger-dir, else a temporary one (removed after a clean run)
  console           the run's stdout, opened with what the run starts
  Ray               start or join the cluster, place every bundle of the job (the entry point may refuse
                    a layout it cannot run: train_async.py needs the engines on GPUs of their own)
  metrics logger    every sink of the run's metrics events
  rollout manager   its engines and router, started and ready; --num-epoch fixes --num-rollout from the
                    number of prompts
  trainer ranks     started, placed (the "placement" event), built and loaded (`start_trainer`)
  first push        the console step around the entry point's first weight push (`first_weight_push`)

Teardown (`__exit__`, whether the loop ended or raised): the metrics logger drains, the rollout manager
stops its engines and router, the trainer ranks stop, the bundles go back. `run_entry` is the process around
it: parse, refuse what the script cannot run (exit 2), train (with --max-restarts, a named failure starts a new
session from the last complete checkpoint: slime/ray/driver/healing.py), and report a failure as its details
and one line (exit 1).

A failure of the trainer ranks alone (healing.trainer_side) with a restart to come keeps the serving side: the
engines stay up on their bundles (the placement group stays), only the rollout manager and its router end; the
next session's manager adopts the engines, its data source starts from the checkpoint's position and its first
push gives the engines the checkpoint's weights. --restart-engines-on-heal restarts them too.

The entry points keep the schedule: which rollout generates while which trains, when the weights move.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

from slime.config.layout import ParallelLayout
from slime.config.run_config import run_config_of
from slime.config.run_state import advance, run_state_of
from slime.ray.common.node import PlacementError
from slime.ray.driver.cluster import cluster_address
from slime.ray.driver.healing import (HealingRefusedError, RepeatedFailureError, heal_metrics, note_failure,
                                      restart_metrics, train_with_healing, trainer_side)
from slime.ray.driver.placement import Layout, Placement, create_placement, init_ray, placement_record, use_gpus
from slime.ray.driver.rank_wait import RankWaitError
from slime.ray.driver.rollout_handle import KeptEngines, create_rollout_manager
from slime.ray.driver.trainer_group import RayTrainGroup, remove_temp_ledger_dir, resolve_ledger_dir
from slime.ray.rollout_manager.errors import RolloutError
from slime.utils.metrics_logger import Console, MetricsLogger
from slime.utils.progress_lines import count


@dataclass(frozen=True)
class KeptServing:
    """What a session that failed on the trainer side leaves for the next attempt of the run: the bundles and
    the engines on them."""

    placement: Placement
    engines: KeptEngines

    def stop(self) -> None:
        self.engines.stop()
        self.placement.remove()


_kept_serving: list[KeptServing] = []
"""The serving side a failed session kept for the next session of the run (the driver process runs one run;
at most one entry; `stop_kept_serving` ends it when no session comes)."""


def stop_kept_serving() -> None:
    """The run ends without another session: what a failed one kept serving stops."""
    while _kept_serving:
        _kept_serving.pop().stop()


class RunSession:
    """One run of the driver, from its first start-up line to the last component stopped:

        with RunSession(args) as run:
            actors = run.start_trainer()
            ...
            for rollout_id in run.rollouts():
                ...
    """

    def __init__(self, args, *, check_layout: Callable[[Layout], None] | None = None) -> None:
        self.args = args
        self.check_layout = check_layout
        """What the entry point cannot run on, checked once the bundles are placed (it may raise)."""
        self.console: Console | None = None
        self.placement = None
        self.metrics: MetricsLogger | None = None
        self.rollout = None
        """The rollout manager's proxy (slime/ray/driver/rollout_handle.py)."""
        self.actors: RayTrainGroup | None = None
        """The trainer ranks' proxy, once `start_trainer` started them."""
        self.critic: RayTrainGroup | None = None
        """The critic's ranks (--advantage-estimator ppo), on the actor's bundles or on its own."""
        self.rollout_id: int | None = None
        """The rollout in progress (None before the loop): what a failure is noted with (healing.py)."""
        self.rank_nodes: dict[str, list[str]] = {}
        """Each trainer rank's node address, once placed, by role ("actor", "critic")."""
        self.kept: KeptEngines | None = None
        """Engines an earlier session kept serving, until this session's rollout manager adopts them."""
        self.engines_kept = False
        """This session serves with the engines of the failed one before it."""

    def __enter__(self) -> "RunSession":
        try:
            self._start()
        except BaseException as exc:  # what started is stopped: a restart (healing.py) starts it all again
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def _start(self) -> None:
        args = self.args
        if run_state_of(args).start_rollout_id is None:  # --start-rollout-id wins over --load's position
            advance(args, start_rollout_id=resume_rollout_id(args))
        resolve_ledger_dir(args)
        self.console = announce_start(args)  # stdout: what starts, each slow start-up step, then a line per rollout
        kept = _kept_serving.pop() if _kept_serving else None  # a trainer-side failure before: its bundles, engines
        if kept is not None:
            self.placement, self.kept = kept.placement, kept.engines
        with ray_cluster_step(self.console):
            init_ray(args)
            if self.placement is None:
                self.placement = create_placement(args)
        if self.check_layout is not None:
            self.check_layout(self.placement.layout)
        self.metrics = MetricsLogger(args, self.console)
        if (restart := restart_metrics(args)) is not None:  # --max-restarts: this session is a restart
            self.metrics.log("restart", args.start_rollout_id, restart)
        with self.console.step("engines: starting" if self.kept is None else "engines: kept, starting their manager",
                               "engines ready"):
            self.rollout = (create_rollout_manager(args, self.placement) if self.kept is None
                            else create_rollout_manager(args, self.placement, self.kept))
        self.engines_kept, self.kept = self.kept is not None, None  # the manager owns them now
        if run_state_of(args).num_rollout is None:  # --num-epoch: as many rollouts as the epochs of prompts take
            advance(args, num_rollout=args.num_epoch * self.rollout.num_prompts() // args.rollout_batch_size)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            note_failure(exc, self.args.start_rollout_id if self.rollout_id is None else self.rollout_id,
                         self.rank_nodes)
        kept = self._keep_serving() if exc is not None and self._may_keep_serving(exc) else None
        steps = [self.metrics and self.metrics.close, kept is None and self.rollout and self.rollout.shutdown,
                 self.actors and self.actors.shutdown, self.critic and self.critic.shutdown,
                 self.kept and self.kept.stop,  # engines kept for this session that it never adopted
                 kept is None and self.placement and self.placement.remove]  # last: a restart places the job anew
        for step in filter(None, steps):
            if exc is None:
                step()
                continue
            try:  # after a failure, what is already broken must not hide it
                step()
            except Exception:  # noqa: BLE001 - logged; the failure that ended the run is the one raised
                logging.getLogger(__name__).exception("teardown after a failure: %s failed", step.__qualname__)
        if kept is not None:
            _kept_serving.append(kept)

    def _may_keep_serving(self, exc: BaseException) -> bool:
        """A restart comes (--max-restarts not spent), the trainer alone failed, and there are engines to keep."""
        args = self.args
        return (run_state_of(args).restart_count < run_config_of(args).healing.max_restarts
                and not args.restart_engines_on_heal
                and trainer_side(exc) and self.rollout is not None and self.placement is not None
                and bool(self.placement.layout.engines))

    def _keep_serving(self) -> KeptServing | None:
        """The engines left serving for the next session (None: one was not serving, and all stop)."""
        try:
            engines = self.rollout.keep_engines()
        except Exception:  # noqa: BLE001 - the engines then stop with the rest
            logging.getLogger(__name__).exception("the engines could not be kept through the restart")
            return None
        if engines is None:
            return None
        logging.getLogger(__name__).info("the trainer alone failed: the engines keep serving through the restart")
        return KeptServing(self.placement, engines)

    def start_trainer(self, *, build: bool = True) -> RayTrainGroup | None:
        """The trainer ranks: started on their bundles, placed (the "placement" event, engines included),
        built and loaded. build=False (--debug-rollout-only): no trainer, the placement event still."""
        args, console = self.args, self.console
        ranks = []
        if build:
            with console.step("trainer ranks: starting their processes", "trainer ranks started"):
                self.actors = RayTrainGroup(args, self.placement)
                ranks = self.actors.where()
                self.rank_nodes["actor"] = [rank["node_ip"] for rank in ranks]
                if args.use_critic:
                    self.critic = RayTrainGroup(args, self.placement, role="critic")
                    critic = self.critic.where()
                    self.rank_nodes["critic"] = [rank["node_ip"] for rank in critic]
                    ranks += [{**r, "role": "critic"} for r in critic]
        self.metrics.log("placement", args.start_rollout_id, placement_record(ranks, self.rollout.engine_endpoints()))
        if self.actors is not None:
            with console.step("trainer ranks: building the model, loading the weights", "trainer ranks initialised"):
                self.actors.init(self.rollout.engine_urls())
                if self.critic is not None:
                    self.critic.init([])  # the critic's weights never reach the engines
        return self.actors

    def first_weight_push(self):
        """The start-up step around the first weight push (the engines get the trainer's weights)."""
        return self.console.step("first weight push", "first weight push done")

    def rollouts(self) -> Iterator[int]:
        """The run's rollout ids; start-up is over at the first, and each one's line is printed once the
        loop's body for it returned."""
        self.console.rollouts_begin()
        for rollout_id in range(self.args.start_rollout_id, self.args.num_rollout):
            self.rollout_id = rollout_id
            yield rollout_id
            self.metrics.rollout_done(rollout_id)
            if rollout_id == self.args.start_rollout_id and (healed := heal_metrics(self.args, self.engines_kept)):
                self.metrics.log("healed", rollout_id, healed)  # a restart's first rollout is done: the heal's time


def run_entry(script: str, train: Callable, check: Callable, argv: list[str] | None, logger: logging.Logger) -> int:
    """Parse, refuse what `script` cannot run (exit 2), train; a named failure ends with exit 1 and one line."""
    from slime.checkpoint.contents import CheckpointMismatchError
    from slime.config.errors import ArgumentValidationError
    from slime.config.launch import check_launch_inputs
    from slime.config.parse import parse_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        check(args)  # what this script cannot run, first: no file is read for a job refused anyway
        check_launch_inputs(args)
    except ArgumentValidationError as exc:
        print(f"{script}: error: {exc}", file=sys.stderr)
        return 2
    try:
        train_with_healing(train, args, multi_node=args.actor_num_nodes > 1)  # --max-restarts: healing.py
    except (HealingRefusedError, RepeatedFailureError, CheckpointMismatchError) as exc:
        logger.error("training stopped: %s (ledger dir %s)", exc, run_state_of(args).ledger_dir)
        return 1
    except (RankWaitError, TimeoutError, RolloutError, PlacementError) as exc:
        # The rank's traceback and one table of every rank (a placement error: what to change), then the one
        # line that matters.
        if getattr(exc, "details", ""):
            logger.error("\n%s", exc.details)
        logger.error("training stopped: %s (ledger dir %s)", exc, run_state_of(args).ledger_dir)
        return 1
    except Exception as exc:  # anything else: its traceback, then the same one line
        logger.exception("unexpected error")
        logger.error("training stopped: %s: %s (ledger dir %s)", type(exc).__name__, exc,
                     run_state_of(args).ledger_dir)
        return 1
    finally:
        stop_kept_serving()  # engines a failed session kept for a restart that did not come
    remove_temp_ledger_dir(args)
    return 0


def announce_start(args) -> Console:
    """The run's stdout, opened with what the run starts (before Ray: nothing slow has happened yet)."""
    console = Console(args)
    console.say(start_line(args, device="GPU" if use_gpus(args) else "CPU"))
    return console


def parallel_layout(layout: ParallelLayout) -> str:
    """'TP2 x SP x CP4' (sizes of 1 left out; DP when more than one)."""
    parts = [f"TP{layout.tp}" if layout.tp > 1 else "", "SP" if layout.sequence_parallel else "",
             f"PP{layout.pp}" if layout.pp > 1 else "", f"CP{layout.cp}" if layout.cp > 1 else "",
             f"DP{layout.dp}" if layout.dp > 1 else "", f"EP{layout.ep}" if layout.ep > 1 else ""]
    return " x ".join(p for p in parts if p) or "one rank"


def start_line(args, *, device: str) -> str:
    """What the run starts, printed before anything slow happens (from the flags alone: args.run_config)."""
    run = args.run_config
    roles, per_engine = run.roles, run.roles.gpus_per_engine
    what = []
    if roles.trainer_ranks:
        what.append(f"{count(roles.trainer_ranks, 'trainer rank')} ({parallel_layout(run.layout)})")
    if roles.critic_ranks:
        where = "on GPUs of their own" if roles.critic_own_bundles else "on the trainer ranks' GPUs"
        what.append(f"{count(roles.critic_ranks, 'critic rank')} {where}")
    if roles.engines:
        what.append(count(roles.engines, "engine") + (f" of {per_engine} GPUs each"
                                                      if device == "GPU" and per_engine > 1 else ""))
    mode = "colocated" if roles.colocate else "engines apart"
    rollouts = args.num_rollout  # not in run_config: the session derives it from --num-epoch once the data is read
    batch = f"{run.rollout.prompts} prompts x {run.rollout.samples_per_prompt} samples"
    return (f"starting: {', '.join(what) or 'nothing'}, {mode}, on {device}; "
            f"{'rollouts by --num-epoch' if rollouts is None else f'{rollouts} rollouts'} of {batch}")


def ray_cluster_step(console: Console):
    """The start-up step that starts or joins the Ray cluster and places the job's bundles."""
    address = cluster_address()
    return console.step(f"Ray cluster: {'joining ' + address if address else 'starting a private one'}, "
                        "placing the bundles", "Ray cluster ready, bundles placed")


def resume_rollout_id(args) -> int:
    """The rollout after the last checkpoint under --load (0 without one, or with --finetune)."""
    from slime.checkpoint.contents import latest_iteration

    last = latest_iteration(args.load) if args.load else None
    start = 0 if last is None or args.finetune else last + 1
    if start > 0:
        check_data_position(args, start - 1)
    if args.use_critic:
        check_critic_position(args)
    return start


def check_critic_position(args) -> None:
    """The critic resumes at the actor's iteration: a critic checkpoint without it is named here, before Ray
    (also at a restart, whose checks ran at the run's start)."""
    from slime.checkpoint.contents import CheckpointMismatchError
    from slime.config.critic_role import critic_checkpoint_mismatch

    problem = critic_checkpoint_mismatch(args)
    if problem:
        raise CheckpointMismatchError(f"--advantage-estimator ppo: {problem}")


def check_data_position(args, rollout_id: int) -> None:
    """The default data source resumes from the position saved after `rollout_id`: a missing file is named
    before Ray starts, not after the engines are up."""
    from slime.rollout.data_source import saved_data_position
    from slime.config.constants import DEFAULT_DATA_SOURCE_PATH

    if args.data_source_path == DEFAULT_DATA_SOURCE_PATH:
        saved_data_position(args, rollout_id)
