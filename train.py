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

from slime.ray.driver.trainer_group import RayTrainGroup, resolve_ledger_dir
from slime.ray.driver.loop import (
    announce_start,
    catch_up,
    check_alternating_args,
    eval_due,
    log_unless_custom,
    ray_cluster_step,
    resume_rollout_id,
    run_entry,
    save_due,
)
from slime.ray.driver.placement import create_placement, init_ray, placement_record
from slime.ray.rollout_manager.manager import create_rollout_manager
from slime.utils.metrics_logger import MetricsLogger

logger = logging.getLogger("slime.train")


def train(args) -> None:
    if getattr(args, "start_rollout_id", None) is None:  # --start-rollout-id wins over --load's position
        args.start_rollout_id = resume_rollout_id(args)
    resolve_ledger_dir(args)
    console = announce_start(args)  # stdout: what starts, each slow start-up step, then a line per rollout
    with ray_cluster_step(console):
        init_ray(args)
        placement = create_placement(args)
    metrics = MetricsLogger(args, console)
    with console.step("engines: starting", "engines ready"):
        rollout = create_rollout_manager(args, placement)
    if args.num_rollout is None:  # --num-epoch: as many rollouts as the epochs of prompts take
        args.num_rollout = args.num_epoch * rollout.num_prompts() // args.rollout_batch_size
    actors = None
    try:
        if engines_release_memory(args):  # before the trainer is built: one side owns each GPU
            metrics.log("memory", args.start_rollout_id - 1, rollout.offload())
        ranks = []
        if not args.debug_rollout_only:
            with console.step("trainer ranks: starting their processes", "trainer ranks started"):
                actors = RayTrainGroup(args, placement)
                ranks = actors.where()
        metrics.log("placement", args.start_rollout_id,
                    placement_record(ranks, rollout.engine_endpoints()))
        if actors is not None:
            with console.step("trainer ranks: building the model, loading the weights", "trainer ranks initialised"):
                actors.init(rollout.engine_urls())
            rollout.attach_trainer(lambda urls, version: catch_up(actors, metrics, urls, version))
            if args.offload_train:
                metrics.log("memory", args.start_rollout_id - 1, actors.sleep())
            if not args.debug_train_only:
                with console.step("first weight push", "first weight push done"):
                    sync_weights(args, args.start_rollout_id - 1, rollout, actors, metrics)
        console.rollouts_begin()
        for rollout_id in range(args.start_rollout_id, args.num_rollout):
            run_rollout(args, rollout_id, rollout, actors, metrics)
            metrics.rollout_done(rollout_id)
    finally:
        metrics.close()
        rollout.shutdown()
        if actors is not None:
            actors.shutdown()


def run_rollout(args, rollout_id: int, rollout, actors, metrics: MetricsLogger) -> None:
    if eval_due(args, rollout_id, before_train=True):
        log_unless_custom(metrics, "eval", rollout_id, rollout.evaluate(rollout_id))
    data_ref, rollout_metrics = rollout.generate(rollout_id)
    log_unless_custom(metrics, "rollout", rollout_id, rollout_metrics)
    if actors is None:  # --debug-rollout-only
        return
    memory = rollout.offload() if engines_release_memory(args) else {}
    logger.info("Timer actor_train start (rollout %d)", rollout_id)
    metrics.log("train", rollout_id, actors.train(rollout_id, data_ref))
    if save_due(args, rollout_id):
        actors.save(rollout_id)
    if args.offload_train:
        memory.update(actors.sleep())
    if memory:
        metrics.log("memory", rollout_id, memory)
    sync_weights(args, rollout_id, rollout, actors, metrics)
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
