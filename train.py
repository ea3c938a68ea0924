"""Entry point: `python train.py <upstream slime flags>`.

The loop, in upstream's order (colocated: trainer and engines take turns on every GPU):

  start     engines start; with --offload-rollout they release all their memory before the trainer
            is built; the trainer builds, loads, and (--offload-train) sleeps; the engines get the
            trainer's weights (the first sync also carries a resumed --load checkpoint)
  rollout   eval (first rollout) -> generate -> engines release memory -> fenced actor_train -> save
            -> trainer sleeps -> engines resume weights -> fenced weight sync from the sleeping trainer
            -> engines resume the rest (KV cache, CUDA graphs) -> eval

Every wait on the ranks has a deadline that follows their progress (`--fence-timeout`:
slime/utils/deadlines.py); a stall becomes an error that names the phase and the ranks.
"""
from __future__ import annotations

import logging
import sys

from slime.ray.driver.loop import (actor_trains, catch_up, check_alternating_args, eval_due, log_unless_custom,
                                   save_checkpoint, save_due, train_rollout)
from slime.ray.driver.session import RunSession, run_entry
from slime.utils.metrics_logger import MetricsLogger

logger = logging.getLogger("slime.train")


def train(args) -> None:
    with RunSession(args) as run:  # set-up and teardown: slime/ray/driver/session.py
        rollout, metrics = run.rollout, run.metrics
        if engines_release_memory(args):  # before the trainer is built: one side owns each GPU
            metrics.log("memory", args.start_rollout_id - 1, rollout.offload())
        actors = run.start_trainer(build=not args.debug_rollout_only)
        if actors is not None:
            rollout.attach_trainer(lambda urls, version: catch_up(actors, metrics, urls, version))
            if args.offload_train:
                metrics.log("memory", args.start_rollout_id - 1, actors.sleep())
                if run.critic is not None:
                    metrics.log("memory", args.start_rollout_id - 1,
                                {f"critic/{k}": v for k, v in run.critic.sleep().items()})
            if not args.debug_train_only:
                with run.first_weight_push():
                    sync_weights(args, args.start_rollout_id - 1, rollout, actors, metrics)
        for rollout_id in run.rollouts():
            run_rollout(args, rollout_id, rollout, actors, metrics, critic=run.critic)


def run_rollout(args, rollout_id: int, rollout, actors, metrics: MetricsLogger, critic=None) -> None:
    if eval_due(args, rollout_id, before_train=True):
        log_unless_custom(metrics, "eval", rollout_id, rollout.evaluate(rollout_id))
    data_ref, rollout_metrics = rollout.generate(rollout_id)
    log_unless_custom(metrics, "rollout", rollout_id, rollout_metrics)
    if actors is None:  # --debug-rollout-only
        return
    memory = rollout.offload() if engines_release_memory(args) else {}
    logger.info("Timer actor_train start (rollout %d)", rollout_id)
    metrics.log("train", rollout_id, train_rollout(args, rollout_id, data_ref, actors, critic))
    trainers = (actors, critic) if critic is not None else (actors,)
    if save_due(args, rollout_id):
        save_checkpoint(rollout_id, actors, critic)
    if args.offload_train:  # the groups that trained wake; the actor sleeps through --num-critic-only-steps
        for group in trainers if actor_trains(args, rollout_id) else (critic,):
            memory.update({f"{group.role}/{k}" if group is critic else k: v for k, v in group.sleep().items()})
    if memory:
        metrics.log("memory", rollout_id, memory)
    if actor_trains(args, rollout_id):
        sync_weights(args, rollout_id, rollout, actors, metrics)
    elif engines_release_memory(args):  # --num-critic-only-steps: the engines keep their weights
        rollout.onload(None)
    if eval_due(args, rollout_id, before_train=False):
        log_unless_custom(metrics, "eval", rollout_id + 1, rollout.evaluate(rollout_id + 1))


def sync_weights(args, rollout_id: int, rollout, actors, metrics: MetricsLogger) -> None:
    """The engines get the weights trained in `rollout_id` (version rollout_id + 1); with released
    engines, weights come back first and the KV cache only after the push (upstream's order)."""
    if args.debug_train_only:  # no engines
        return
    if engines_release_memory(args):
        rollout.onload(("weights",))
    engine_urls = rollout.engines_for_sync()  # None: the engines of the last push
    metrics.log("weight_sync", rollout_id, actors.update_weights(rollout_id, engine_urls=engine_urls))
    rollout.weights_pushed(engine_urls, rollout_id + 1)
    if engines_release_memory(args):
        rollout.onload(None)  # every tag still released: KV cache, CUDA graphs


def engines_release_memory(args) -> bool:
    return bool(args.offload_rollout) and not args.debug_train_only


def main(argv: list[str] | None = None) -> int:
    return run_entry("train.py", train, check_alternating_args, argv, logger)


if __name__ == "__main__":
    sys.exit(main())
