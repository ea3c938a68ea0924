"""The group of trainer ranks as seen from the driver.

Each method fans one call out to every rank and waits until no rank has made progress for the
driver's window (slime/utils/deadlines.py), as the progress hub the driver starts sees it (every
node's ranks: slime/distributed/progress_hub.py): a margin above the ranks' own window, so that
their named errors arrive first, and no fixed total, so that a long healthy phase (many steps, a
large checkpoint) is never cut short. On a failure or a deadline the driver renders, once, the
hub's table of where every rank is.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any, Callable

import ray

from slime.config.critic_role import critic_args
from slime.config.run_state import actor_args, advance, run_state_of
from slime.distributed.progress_hub import HubClient, RayHub, start_hub
from slime.ray.driver.cluster import worker_env
from slime.ray.driver.rank_wait import wait_ranks
from slime.ray.driver.placement import Placement
from slime.ray.trainer.rank_actor import TrainRayActor
from slime.utils.deadlines import RANK_CLOSE_S, TRAINER_RENDEZVOUS_CALL_S

logger = logging.getLogger(__name__)


def resolve_ledger_dir(args) -> str:
    """--ledger-dir, or a fresh temp dir (made by the run's first session; a restart's session keeps it, and it
    stays temporary); printed so a stuck run can be inspected from another shell."""
    state = run_state_of(args)
    if not state.ledger_dir:
        state = advance(args, ledger_dir=tempfile.mkdtemp(prefix="slime-ledger-"), ledger_dir_is_temp=True)
    logger.info("ledger dir: %s (where is every rank: python -m slime.distributed.hang_report %s)",
                state.ledger_dir, state.ledger_dir)
    return state.ledger_dir


def remove_temp_ledger_dir(args) -> None:
    """After a run that ended cleanly: the temp ledger dir made for it goes (a failed run keeps it)."""
    state = run_state_of(args)
    if state.ledger_dir_is_temp:
        shutil.rmtree(state.ledger_dir, ignore_errors=True)


class RayTrainGroup:
    """The ranks of one role: the actor's, or the critic's (--advantage-estimator ppo: on the actor's bundles, or
    on its own with --critic-num-* other than the actor's), with their own flags (critic_role.critic_args), world,
    ledger directory (<ledger dir>/critic) and progress hub."""

    def __init__(self, args, placement: Placement, role: str = "actor"):
        self.role = role
        self.ledger_dir = run_state_of(args).ledger_dir or resolve_ledger_dir(args)
        if role == "critic":
            args = critic_args(args)
            self.ledger_dir = os.path.join(self.ledger_dir, role)
            os.makedirs(self.ledger_dir, exist_ok=True)
        self.args = args
        self.world_size = args.run_config.layout.world_size  # the role's own (critic_args rebuilds it)
        self.deadlines = args.run_config.deadlines
        self.hub = start_hub(self.world_size, runtime_env={"env_vars": worker_env(use_gpu=False)})
        self.progress = HubClient(RayHub(*self.hub))  # the driver's view: asks only
        remote = ray.remote(TrainRayActor)
        state, ranks_args = run_state_of(args), actor_args(args)  # the state is the ranks' argument, not a flag
        self._ranks = []
        try:
            for rank in range(self.world_size):
                self._ranks.append(remote.options(**placement.trainer_options(rank, role)).remote(
                    ranks_args, state, rank, self.world_size, self.ledger_dir, self.hub, role))
        except BaseException:  # nothing owns this group yet: what it started ends here
            self._kill()
            raise

    def where(self) -> list[dict]:
        """Each rank's own account of its node and GPU, in rank order."""
        return self._wait([r.where.remote() for r in self._ranks], "placement", self.deadlines.driver_init_window_s)

    def init(self, engine_urls: list[str]) -> None:
        rendezvous = self._ranks[0].rendezvous_address.remote()
        master_addr, master_port = ray.get(rendezvous, timeout=TRAINER_RENDEZVOUS_CALL_S)
        refs = [r.init.remote(master_addr, master_port, engine_urls) for r in self._ranks]
        starts = self._wait(refs, "init", self.deadlines.driver_init_window_s)
        explicit = run_state_of(self.args).start_rollout_id_given  # --start-rollout-id wins over --load
        if len(set(starts)) != 1 or (not explicit and set(starts) != {self.args.start_rollout_id}):
            raise RuntimeError(f"{self.role} ranks resumed at rollouts {sorted(set(starts))}, the driver at "
                               f"{self.args.start_rollout_id}: is --load readable the same way by every rank "
                               "(the critic: --critic-load or <--load>/critic holds its checkpoint)?")

    def train(self, rollout_id: int, data_ref: ray.ObjectRef, on_poll: Callable[[], None] | None = None,
              extra_refs: tuple = ()) -> dict[str, Any]:
        """`on_poll`: watches what runs meanwhile (train_async.py: the next rollout's generation);
        `extra_refs`: fields added to the rollout (the critic's values)."""
        # The data refs are passed inside a list so Ray does not resolve them in the call path:
        # each rank fetches them itself, under its own deadline.
        refs = [r.train.remote(rollout_id, [data_ref, *extra_refs]) for r in self._ranks]
        return self._wait(refs, f"{self.role}_train", on_poll=on_poll)[0]

    def values(self, rollout_id: int, data_ref: ray.ObjectRef, on_poll: Callable[[], None] | None = None
               ) -> ray.ObjectRef:
        """A reference to the critic's values of every response token of the rollout (`{"values": ...}`, put by
        rank 0): the driver never fetches them; `train`'s `extra_refs` hands the reference to the ranks."""
        refs = [r.values.remote(rollout_id, [data_ref]) for r in self._ranks]
        return self._wait(refs, "critic_values", on_poll=on_poll)[0]

    def update_weights(self, rollout_id: int, engine_urls: list[str] | None = None, *, served: bool = False,
                       keep_served: bool | None = None) -> dict[str, Any]:
        """Push the weights of rollout `rollout_id` (version rollout_id + 1); `engine_urls` re-aims the
        trainer at a new set of engines (fault tolerance restarted some). `served`/`keep_served`: the copy of
        what the engines hold that train_async.py saves with a checkpoint (MegatronTrainActor.update_weights)."""
        refs = [r.update_weights.remote(rollout_id, engine_urls, served=served, keep_served=keep_served)
                for r in self._ranks]
        return self._wait(refs, "weight_sync")[0]

    def sleep(self) -> dict[str, float]:
        """Every rank frees its model and optimizer memory; the figures are the largest over the ranks."""
        per_rank = self._wait([r.sleep.remote() for r in self._ranks], self._phase("sleep"))
        return {key: max(m[key] for m in per_rank) for key in sorted(per_rank[0])}

    def save(self, rollout_id: int, publish: bool = True) -> None:
        """publish=False: the iteration is written and in place, its tracker left for `publish`."""
        self._wait([r.save.remote(rollout_id, publish) for r in self._ranks], self._phase("save"))

    def publish(self, rollout_id: int) -> None:
        self._wait([r.publish.remote(rollout_id) for r in self._ranks], self._phase("publish"))

    def _phase(self, name: str) -> str:
        return name if self.role == "actor" else f"{self.role}_{name}"

    def shutdown(self) -> None:
        """Each rank writes out its ledger (the last ops of a run are in memory only for up to a flush interval),
        then ends. The wait is bounded: a rank that is dead or still stuck in a collective is killed as is."""
        closing = [rank.close.remote() for rank in self._ranks]
        ray.wait(closing, num_returns=len(closing), timeout=RANK_CLOSE_S)
        self._kill()

    def _kill(self) -> None:
        for rank in self._ranks:
            ray.kill(rank, no_restart=True)
        self.progress.close()
        ray.kill(self.hub[0], no_restart=True)

    def _wait(self, refs, phase: str, window_s: float | None = None, on_poll: Callable[[], None] | None = None
              ) -> list:
        from slime.distributed.progress import hang_table

        window_s = window_s or self.deadlines.driver_window_s
        return wait_ranks(refs, phase=phase, window_s=window_s,
                          progress=lambda: self.progress.latest_progress(window_s),
                          describe_hang=lambda: hang_table(self.progress, self.world_size, self.ledger_dir),
                          describe_exit=self._exit_verdict, on_poll=on_poll, role=self.role)

    def _exit_verdict(self) -> str:
        """Why rank processes ended: the HANG lines their watchdogs left at the hub before exiting (every
        node), else in the stacks files here, else where the ledger files here last saw every rank."""
        return "; ".join(self.progress.verdicts()) or exit_verdict(self.ledger_dir, self.world_size)


def exit_verdict(ledger_dir: str, world_size: int) -> str:
    """Why rank processes ended: the HANG lines their watchdogs wrote before exiting (first line of
    each stacks file), else where the ledger files last saw every rank."""
    from slime.distributed.hang_report import summarize_hang, watchdog_verdicts

    return "; ".join(watchdog_verdicts(ledger_dir)) or summarize_hang(ledger_dir, world_size)
