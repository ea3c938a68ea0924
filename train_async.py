"""Entry point: `python train_async.py <upstream slime flags>` (no --colocate).

The loop, in upstream's order (disaggregated: the engines run on GPUs of their own, --rollout-num-gpus):

  start     engines start on their bundles, the trainer on its own; the trainer builds and loads; the
            engines get the trainer's weights over the distributed group (version --start-rollout-id)
  rollout   collect rollout k -> start generating rollout k+1 -> fenced actor_train on rollout k -> save
            -> every --update-weights-interval rollouts: wait for rollout k+1, fenced weight push -> eval

What generates while what trains, when the weights move and which version each rollout is generated
with is the schedule's (slime/ray/driver/async_schedule.py); each overlapping activity keeps its own deadline.
"""
from __future__ import annotations

import logging
import sys

from slime.ray.driver.trainer_group import RayTrainGroup, resolve_ledger_dir
from slime.ray.driver.async_schedule import AsyncSchedule, check_async_args
from slime.ray.driver.loop import (
    announce_start,
    eval_due,
    log_unless_custom,
    ray_cluster_step,
    resume_rollout_id,
    run_entry,
    save_due,
)
from slime.ray.driver.placement import check_disjoint, create_placement, init_ray, placement_record
from slime.ray.rollout_manager.manager import create_rollout_manager
from slime.utils.metrics_logger import MetricsLogger

logger = logging.getLogger("slime.train_async")


def train(args) -> None:
    check_async_args(args)
    if getattr(args, "start_rollout_id", None) is None:  # --start-rollout-id wins over --load's position
        args.start_rollout_id = resume_rollout_id(args)
    resolve_ledger_dir(args)
    console = announce_start(args)  # stdout: what starts, each slow start-up step, then a line per rollout
    with ray_cluster_step(console):
        init_ray(args)
        placement = create_placement(args)
    check_disjoint(placement.layout)
    metrics = MetricsLogger(args, console)
    with console.step("engines: starting", "engines ready"):
        rollout = create_rollout_manager(args, placement)
    if args.num_rollout is None:  # --num-epoch: as many rollouts as the epochs of prompts take
        args.num_rollout = args.num_epoch * rollout.num_prompts() // args.rollout_batch_size
    actors = None
    try:
        with console.step("trainer ranks: starting their processes", "trainer ranks started"):
            actors = RayTrainGroup(args, placement)
            ranks = actors.where()
        metrics.log("placement", args.start_rollout_id, placement_record(ranks, rollout.engine_endpoints()))
        with console.step("trainer ranks: building the model, loading the weights", "trainer ranks initialised"):
            actors.init(rollout.engine_urls())
        schedule = AsyncSchedule(args, rollout, actors, metrics)
        with console.step("first weight push", "first weight push done"):
            schedule.push_weights(args.start_rollout_id - 1)  # the engines start from the trainer's weights
        console.rollouts_begin()
        schedule.start_generation(args.start_rollout_id)
        for rollout_id in range(args.start_rollout_id, args.num_rollout):
            data_ref = schedule.collect(rollout_id)
            if rollout_id + 1 < args.num_rollout:  # the next rollout generates while this one trains
                schedule.start_generation(rollout_id + 1)
            schedule.train(rollout_id, data_ref)
            if save_due(args, rollout_id):
                actors.save(rollout_id)
            if schedule.push_due(rollout_id):
                schedule.push_weights(rollout_id)
            if eval_due(args, rollout_id, before_train=False):
                log_unless_custom(metrics, "eval", rollout_id + 1, schedule.evaluate(rollout_id + 1))
            metrics.rollout_done(rollout_id)
    finally:
        metrics.close()
        rollout.shutdown()
        if actors is not None:
            actors.shutdown()


def main(argv: list[str] | None = None) -> int:
    return run_entry("train_async.py", train, check_async_args, argv, logger)

if __name__ == "__main__":
    sys.exit(main())
