"""The group of trainer ranks as seen from the driver.

Each method fans one call out to every rank and waits with a deadline derived from
`--fence-timeout`; ranks enforce the same deadline themselves (watchdog), so the driver's
deadline is a backstop with a margin. On a deadline the driver renders, from the ranks'
ledger files, where every rank is.
"""
from __future__ import annotations

import glob
import logging
import os
import tempfile
from typing import Any

import ray

from slime.ray.deadline import wait_ranks
from slime.ray.placement import Placement, actor_world_size
from slime.ray.train_actor import TrainRayActor

logger = logging.getLogger(__name__)

# Ranks give up after `--fence-timeout` per phase; the driver waits a little longer so that the
# ranks' own named errors arrive first.
DRIVER_MARGIN = 1.5
# Model build, checkpoint load and Ray start-up are not fenced phases: they get a fixed allowance.
INIT_ALLOWANCE_S = 600.0


class RayTrainGroup:
    def __init__(self, args, placement: Placement):
        self.args = args
        self.world_size = actor_world_size(args)
        self.ledger_dir = args.ledger_dir or tempfile.mkdtemp(prefix="slime-ledger-")
        remote = ray.remote(TrainRayActor)
        self._ranks = [remote.options(**placement.trainer_options(rank)).remote(
            args, rank, self.world_size, self.ledger_dir) for rank in range(self.world_size)]

    def where(self) -> list[dict]:
        """Each rank's own account of its node and GPU, in rank order."""
        return self._wait([r.where.remote() for r in self._ranks], "placement", INIT_ALLOWANCE_S)

    def init(self, engine_urls: list[str]) -> None:
        master_addr, master_port = ray.get(self._ranks[0].rendezvous_address.remote(), timeout=120)
        refs = [r.init.remote(master_addr, master_port, engine_urls) for r in self._ranks]
        starts = self._wait(refs, "init", INIT_ALLOWANCE_S + 3 * self.args.fence_timeout)
        if set(starts) != {self.args.start_rollout_id}:
            raise RuntimeError(f"ranks resumed at rollouts {sorted(set(starts))}, the driver at "
                               f"{self.args.start_rollout_id}: is --load readable the same way by every rank?")

    def train(self, rollout_id: int, data_ref: ray.ObjectRef) -> dict[str, Any]:
        # The data ref is passed inside a list so Ray does not resolve it in the call path:
        # each rank fetches it itself, under its own deadline.
        refs = [r.train.remote(rollout_id, [data_ref]) for r in self._ranks]
        return self._wait(refs, "actor_train", self._step_deadline())[0]

    def update_weights(self, rollout_id: int) -> dict[str, Any]:
        refs = [r.update_weights.remote(rollout_id) for r in self._ranks]
        return self._wait(refs, "weight_sync", self._step_deadline())[0]

    def sleep(self) -> dict[str, float]:
        """Every rank frees its model and optimizer memory; the figures are the largest over the ranks."""
        per_rank = self._wait([r.sleep.remote() for r in self._ranks], "sleep", self._phase_deadline())
        return {key: max(m[key] for m in per_rank) for key in sorted(per_rank[0])}

    def save(self, rollout_id: int) -> None:
        self._wait([r.save.remote(rollout_id) for r in self._ranks], "save", INIT_ALLOWANCE_S)

    def shutdown(self) -> None:
        for rank in self._ranks:
            ray.kill(rank, no_restart=True)

    def _phase_deadline(self) -> float:
        return self.args.fence_timeout * DRIVER_MARGIN + 30

    def _step_deadline(self) -> float:
        # A step has several phases, each bounded by fence_timeout on the ranks; the whole step is
        # bounded here so that even a rank whose watchdog died cannot hold the driver forever.
        return self.args.fence_timeout * 4 + 60

    def _wait(self, refs, phase: str, timeout_s: float) -> list:
        from slime.distributed.watchdog import render_hang_report

        return wait_ranks(refs, phase=phase, timeout_s=timeout_s,
                          describe_hang=lambda: render_hang_report(self.ledger_dir, self.world_size),
                          describe_exit=lambda: exit_verdict(self.ledger_dir, self.world_size))


def exit_verdict(ledger_dir: str, world_size: int) -> str:
    """Why rank processes ended: the HANG lines their watchdogs wrote before exiting (first line of
    each stacks file), else where the ledger files last saw every rank."""
    from slime.distributed.hang_report import summarize_hang

    lines = []
    for path in sorted(glob.glob(os.path.join(ledger_dir, "stacks_rank*.txt"))):
        with open(path) as f:
            lines.append(f.readline().strip())
    verdicts = list(dict.fromkeys(line for line in lines if line))
    return "; ".join(verdicts) if verdicts else summarize_hang(ledger_dir, world_size)
