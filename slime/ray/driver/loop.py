"""What the two loops share inside a run (train.py alternates, train_async.py overlaps): when eval and save
are due, events a logging hook may take over, and how engines restarted during a rollout get the trainer's
current weights. How a run starts and ends is the session's (slime/ray/driver/session.py)."""
from __future__ import annotations

from typing import Callable

from slime.utils.metrics_logger import MetricsLogger


def check_alternating_args(args) -> None:
    """train.py pushes after every rollout: a longer interval is train_async.py's."""
    from slime.config.errors import ArgumentValidationError

    if args.update_weights_interval != 1:
        raise ArgumentValidationError(f"--update-weights-interval {args.update_weights_interval} is train_async.py's: "
                                      "train.py pushes the weights after every rollout (drop the flag, or run "
                                      "train_async.py)")


def eval_due(args, rollout_id: int, *, before_train: bool) -> bool:
    if not args.eval_interval or not args.eval_prompt_data or args.debug_train_only:
        return False
    if before_train:
        return rollout_id == 0 and not args.skip_eval_before_train
    return (rollout_id + 1) % args.eval_interval == 0 or rollout_id + 1 == args.num_rollout


def save_due(args, rollout_id: int) -> bool:
    if not args.save or not args.save_interval:
        return False
    return (rollout_id + 1) % args.save_interval == 0 or rollout_id + 1 == args.num_rollout


def save_checkpoint(rollout_id: int, actors, critic=None) -> None:
    """The run's checkpoint of `rollout_id`: the critic's iteration first, then the actor's, whose tracker is the
    run's, then the critic's tracker. Stopped anywhere in between, the run resumes both roles at the iteration the
    actor's tracker names, which both hold (the critic resumes at the actor's iteration: config/critic_role.py)."""
    if critic is not None:
        critic.save(rollout_id, publish=False)
    actors.save(rollout_id)
    if critic is not None:
        critic.publish(rollout_id)


def log_unless_custom(metrics: MetricsLogger, kind: str, rollout_id: int, values: dict) -> None:
    # {}: a --custom-(eval-)rollout-log-function-path returned True and did the logging itself
    if values:
        metrics.log(kind, rollout_id, values)


def catch_up(actors, metrics: MetricsLogger, engine_urls: list[str], version: int) -> dict:
    """--use-fault-tolerance: engines restarted during a rollout get the trainer's weights, as `version`."""
    result = actors.update_weights(version - 1, engine_urls=engine_urls)
    metrics.log("engine_catch_up", version - 1, result)
    return result


def actor_trains(args, rollout_id: int) -> bool:
    """--num-critic-only-steps N: the first N rollouts train the critic only (the actor and its weights stay)."""
    return rollout_id >= args.num_critic_only_steps


def train_rollout(args, rollout_id: int, data_ref, actors, critic=None,
                  on_poll: Callable[[], None] | None = None) -> dict:
    """One rollout's training. ppo (`critic` given): the critic values the rollout, its values join the data of
    both roles (the actor's GAE advantages, the critic's returns), the critic steps, then the actor."""
    poll = {"on_poll": on_poll} if on_poll is not None else {}
    if critic is None:
        return actors.train(rollout_id, data_ref, **poll)
    values_ref = critic.values(rollout_id, data_ref, **poll)  # a reference: the values stay off the driver
    metrics = critic.train(rollout_id, data_ref, extra_refs=(values_ref,), **poll)
    if actor_trains(args, rollout_id):
        metrics.update(actors.train(rollout_id, data_ref, extra_refs=(values_ref,), **poll))
    return metrics
