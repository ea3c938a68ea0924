"""What the two entry scripts share (train.py alternates, train_async.py overlaps): how a run starts and
ends (`run_entry`), where a resumed run starts, when eval and save are due, events a logging hook may take
over, and how engines restarted during a rollout get the trainer's current weights."""
from __future__ import annotations

import logging
import sys
from typing import Callable

from slime.utils.metrics_logger import Console, MetricsLogger


def run_entry(script: str, train: Callable, check: Callable, argv: list[str] | None, logger: logging.Logger) -> int:
    """Parse, refuse what `script` cannot run (exit 2), train; a named failure ends with exit 1 and one line."""
    from slime.ray.driver.trainer_group import remove_temp_ledger_dir
    from slime.ray.driver.cluster import PlacementError
    from slime.ray.driver.rank_wait import RankWaitError
    from slime.ray.rollout_manager.errors import RolloutError
    from slime.utils.arguments import ArgumentValidationError, check_launch_inputs, parse_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        check(args)  # what this script cannot run, first: no file is read for a job refused anyway
        check_launch_inputs(args)
    except ArgumentValidationError as exc:
        print(f"{script}: error: {exc}", file=sys.stderr)
        return 2
    try:
        train(args)
    except (RankWaitError, TimeoutError, RolloutError, PlacementError) as exc:
        # The rank's traceback and one table of every rank (a placement error: what to change), then the one
        # line that matters.
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


def announce_start(args) -> Console:
    """The run's stdout, opened with what the run starts (before Ray: nothing slow has happened yet)."""
    from slime.ray.driver.placement import use_gpus
    from slime.utils.progress_lines import start_line

    console = Console(args)
    console.say(start_line(args, device="GPU" if use_gpus(args) else "CPU"))
    return console


def ray_cluster_step(console: Console):
    """The start-up step that starts or joins the Ray cluster and places the job's bundles."""
    from slime.ray.driver.cluster import cluster_address

    address = cluster_address()
    return console.step(f"Ray cluster: {'joining ' + address if address else 'starting a private one'}, "
                        "placing the bundles", "Ray cluster ready, bundles placed")


def check_alternating_args(args) -> None:
    """train.py pushes after every rollout: a longer interval is train_async.py's."""
    from slime.utils.arguments import ArgumentValidationError

    if getattr(args, "update_weights_interval", 1) != 1:
        raise ArgumentValidationError(f"--update-weights-interval {args.update_weights_interval} is train_async.py's: "
                                      "train.py pushes the weights after every rollout (drop the flag, or run "
                                      "train_async.py)")


def resume_rollout_id(args) -> int:
    """The rollout after the last checkpoint under --load (0 without one, or with --finetune)."""
    from slime.checkpoint.contents import latest_iteration

    last = latest_iteration(args.load) if args.load else None
    start = 0 if last is None or getattr(args, "finetune", False) else last + 1
    if start > 0:
        check_data_position(args, start - 1)
    return start


def check_data_position(args, rollout_id: int) -> None:
    """The default data source resumes from the position saved after `rollout_id`: a missing file is named
    before Ray starts, not after the engines are up."""
    from slime.rollout.data_source import saved_data_position
    from slime.utils.arguments import DEFAULT_DATA_SOURCE_PATH

    if getattr(args, "data_source_path", DEFAULT_DATA_SOURCE_PATH) == DEFAULT_DATA_SOURCE_PATH:
        saved_data_position(args, rollout_id)


def eval_due(args, rollout_id: int, *, before_train: bool) -> bool:
    if not args.eval_interval or not args.eval_prompt_data or args.debug_train_only:
        return False
    if before_train:
        return rollout_id == 0 and not getattr(args, "skip_eval_before_train", False)
    return (rollout_id + 1) % args.eval_interval == 0 or rollout_id + 1 == args.num_rollout


def save_due(args, rollout_id: int) -> bool:
    if not args.save or not args.save_interval:
        return False
    return (rollout_id + 1) % args.save_interval == 0 or rollout_id + 1 == args.num_rollout


def log_unless_custom(metrics: MetricsLogger, kind: str, rollout_id: int, values: dict) -> None:
    # {}: a --custom-(eval-)rollout-log-function-path returned True and did the logging itself
    if values:
        metrics.log(kind, rollout_id, values)


def catch_up(actors, metrics: MetricsLogger, engine_urls: list[str], version: int) -> dict:
    """--use-fault-tolerance: engines restarted during a rollout get the trainer's weights, as `version`."""
    result = actors.update_weights(version - 1, engine_urls=engine_urls)
    metrics.log("engine_catch_up", version - 1, result)
    return result
