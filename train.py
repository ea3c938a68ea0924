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

from slime.ray.actor_group import RayTrainGroup, remove_temp_ledger_dir, resolve_ledger_dir
from slime.ray.deadline import RankWaitError
from slime.ray.rollout_errors import RolloutError
from slime.ray.placement import create_placement, init_ray, placement_record
from slime.ray.rollout_manager import create_rollout_manager
from slime.utils.arguments import ArgumentValidationError, check_launch_inputs, parse_args
from slime.utils.metrics_logger import MetricsLogger

logger = logging.getLogger("slime.train")


def train(args) -> None:
    if getattr(args, "start_rollout_id", None) is None:  # --start-rollout-id wins over --load's position
        args.start_rollout_id = resume_rollout_id(args)
    resolve_ledger_dir(args)
    init_ray(args)
    placement = create_placement(args)
    metrics = MetricsLogger(args)
    rollout = create_rollout_manager(args, placement)
    if args.num_rollout is None:  # --num-epoch: as many rollouts as the epochs of prompts take
        args.num_rollout = args.num_epoch * rollout.num_prompts() // args.rollout_batch_size
    actors = None
    try:
        if engines_release_memory(args):  # before the trainer is built: one side owns each GPU
            metrics.log("memory", args.start_rollout_id - 1, rollout.offload())
        if not args.debug_rollout_only:
            actors = RayTrainGroup(args, placement)
        metrics.log("placement", args.start_rollout_id,
                    placement_record(actors.where() if actors else [], rollout.engine_endpoints()))
        if actors is not None:
            actors.init(rollout.engine_urls())
            rollout.attach_trainer(lambda urls, version: _catch_up(actors, metrics, urls, version))
            if args.offload_train:
                metrics.log("memory", args.start_rollout_id - 1, actors.sleep())
            sync_weights(args, args.start_rollout_id - 1, rollout, actors, metrics)
        for rollout_id in range(args.start_rollout_id, args.num_rollout):
            run_rollout(args, rollout_id, rollout, actors, metrics)
    finally:
        metrics.close()
        rollout.shutdown()
        if actors is not None:
            actors.shutdown()


def run_rollout(args, rollout_id: int, rollout, actors, metrics: MetricsLogger) -> None:
    if _eval_due(args, rollout_id, before_train=True):
        _log_unless_custom(metrics, "eval", rollout_id, rollout.evaluate(rollout_id))
    data_ref, rollout_metrics = rollout.generate(rollout_id)
    _log_unless_custom(metrics, "rollout", rollout_id, rollout_metrics)
    if actors is None:  # --debug-rollout-only
        return
    memory = rollout.offload() if engines_release_memory(args) else {}
    logger.info("Timer actor_train start (rollout %d)", rollout_id)
    metrics.log("train", rollout_id, actors.train(rollout_id, data_ref))
    if _save_due(args, rollout_id):
        actors.save(rollout_id)
    if args.offload_train:
        memory.update(actors.sleep())
    if memory:
        metrics.log("memory", rollout_id, memory)
    sync_weights(args, rollout_id, rollout, actors, metrics)
    if _eval_due(args, rollout_id, before_train=False):
        _log_unless_custom(metrics, "eval", rollout_id + 1, rollout.evaluate(rollout_id + 1))


def _log_unless_custom(metrics: MetricsLogger, kind: str, rollout_id: int, values: dict) -> None:
    # {}: a --custom-(eval-)rollout-log-function-path returned True and did the logging itself
    if values:
        metrics.log(kind, rollout_id, values)


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


def _catch_up(actors, metrics: MetricsLogger, engine_urls: list[str], version: int) -> dict:
    """--use-fault-tolerance: engines restarted during a rollout get the trainer's current weights."""
    result = actors.update_weights(version - 1, engine_urls=engine_urls)
    metrics.log("engine_catch_up", version - 1, result)
    return result


def engines_release_memory(args) -> bool:
    return bool(args.offload_rollout) and not args.debug_train_only


def resume_rollout_id(args) -> int:
    """The rollout after the last checkpoint under --load (0 without one, or with --finetune)."""
    from slime.backends.megatron_utils.checkpoint import latest_iteration

    last = latest_iteration(args.load) if args.load else None
    return 0 if last is None or getattr(args, "finetune", False) else last + 1


def _eval_due(args, rollout_id: int, *, before_train: bool) -> bool:
    if not args.eval_interval or not args.eval_prompt_data or args.debug_train_only:
        return False
    if before_train:
        return rollout_id == 0 and not getattr(args, "skip_eval_before_train", False)
    return (rollout_id + 1) % args.eval_interval == 0 or rollout_id + 1 == args.num_rollout


def _save_due(args, rollout_id: int) -> bool:
    if not args.save or not args.save_interval:
        return False
    return (rollout_id + 1) % args.save_interval == 0 or rollout_id + 1 == args.num_rollout


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        check_launch_inputs(args)
    except ArgumentValidationError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    try:
        train(args)
    except (RankWaitError, TimeoutError, RolloutError) as exc:
        # The rank's traceback and one table of every rank, then the one line that matters.
        if getattr(exc, "details", ""):
            logger.error("\n%s", exc.details)
        logger.error("training stopped: %s (ledger dir %s)", exc, args.ledger_dir)
        return 1
    except Exception as exc:  # anything else: its traceback, then the same one line
        logger.exception("unexpected error")
        logger.error("training stopped: %s: %s (ledger dir %s)", type(exc).__name__, exc, args.ledger_dir)
        return 1
    remove_temp_ledger_dir(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
