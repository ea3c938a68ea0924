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

from slime.ray.driver.async_schedule import AsyncSchedule, check_async_args
from slime.ray.driver.loop import eval_due, log_unless_custom, save_checkpoint, save_due
from slime.ray.driver.placement import check_disjoint
from slime.ray.driver.session import RunSession, run_entry

logger = logging.getLogger("slime.train_async")


def train(args) -> None:
    check_async_args(args)
    with RunSession(args, check_layout=check_disjoint) as run:  # set-up and teardown: slime/ray/driver/session.py
        actors = run.start_trainer()
        schedule = AsyncSchedule(args, run.rollout, actors, run.metrics, critic=run.critic)
        with run.first_weight_push():
            schedule.push_at_start()  # the trainer's weights, or those the engines held when --load was saved
        schedule.start_generation(args.start_rollout_id)
        schedule.replay_push()  # resumed: the push that followed that rollout's generation before the run stopped
        for rollout_id in run.rollouts():
            data_ref = schedule.collect(rollout_id)
            if rollout_id + 1 < args.num_rollout:  # the next rollout generates while this one trains
                schedule.start_generation(rollout_id + 1)
            schedule.train(rollout_id, data_ref)
            if save_due(args, rollout_id):
                save_checkpoint(rollout_id, actors, run.critic)
            if schedule.push_due(rollout_id):
                schedule.push_weights(rollout_id)
            if eval_due(args, rollout_id, before_train=False):
                log_unless_custom(run.metrics, "eval", rollout_id + 1, schedule.evaluate(rollout_id + 1))


def main(argv: list[str] | None = None) -> int:
    return run_entry("train_async.py", train, check_async_args, argv, logger)


if __name__ == "__main__":
    sys.exit(main())
