"""train_async.py's schedule: which rollout generates while which trains, when the weights move, and which
weight version every rollout is generated with. Upstream slime's one-step-off loop:

    start        the engines get the trainer's weights (version S = --start-rollout-id); rollout S generates
    rollout k    collect rollout k -> start generating rollout k+1 -> train on rollout k
                 -> when (k+1) % --update-weights-interval == 0: wait for rollout k+1, push version k+1

So rollout k+1 is generated with the engines' version when it starts (k with the default interval 1, one
step behind the trainer, which trains on it at version k+1), and a push never meets a running generation
of the default rollout function: the only thing generating then is a background generator
(slime.rollout.fully_async_rollout), which the rollout manager holds for the push (its requests are
aborted and redone, or continued with --partial-rollout; slime/rollout/generation_gate.py).

A resume keeps the schedule: a checkpoint saved after training rollout k holds the trainer's version k+1,
while the engines then held an older one, the version rollout k+1 was generated with. So every push after
which a save comes keeps a host copy of what it pushed, saved with the checkpoint (`served`), and a run
resumed from it pushes that copy first (as its version), generates rollout k+1 with it, then makes the push
the run that never stopped made after training rollout k (`replays_push`), and goes on as that run did.

`OneStepOffPlan` is that timeline as data (pure, unit-tested); `AsyncSchedule` runs it. Each of the two
activities that overlap keeps its own deadline: the trainer's phases the ranks' progress window
(slime/utils/deadlines.py, through RayTrainGroup), the rollout in flight its manager's deadline
(--rollout-timeout, extended by engine recoveries) plus the driver's margin (slime/ray/driver/rollout_wait.py).
While the trainer trains, the rollout is polled every second: a rollout that fails or passes its deadline
stops the run at once, and engines that fault tolerance restarted meanwhile get the trainer's weights as
soon as the trainer is free (its version then, recorded by every sample they generate).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from slime.ray.driver.loop import catch_up, log_unless_custom, save_due, train_rollout
from slime.ray.driver.rollout_wait import RolloutWatch
from slime.config.errors import ArgumentValidationError
from slime.utils.metrics_logger import MetricsLogger

logger = logging.getLogger(__name__)


def check_async_args(args) -> None:
    """What train_async.py cannot run, with what to do instead (upstream refuses --colocate too)."""
    if args.colocate:
        raise ArgumentValidationError(
            "--colocate is not supported by train_async.py: it generates the next rollout while the trainer trains, "
            "so engines and trainer cannot share GPUs; drop --colocate and give the engines their own with "
            "--rollout-num-gpus N, or run train.py to alternate on shared GPUs")
    for flag, on in (("--offload-train", args.offload_train), ("--offload-rollout", args.offload_rollout)):
        if on:
            raise ArgumentValidationError(f"{flag} hands GPUs between trainer and engines, which train_async.py runs "
                                          "at once on GPUs of their own: drop it (or run train.py --colocate)")
    for flag, on in (("--debug-train-only", args.debug_train_only), ("--debug-rollout-only", args.debug_rollout_only)):
        if on:
            raise ArgumentValidationError(f"{flag} leaves nothing to overlap: run train.py {flag}")
    if not args.rollout_num_gpus:
        raise ArgumentValidationError("train_async.py needs engines of their own: set --rollout-num-gpus N "
                                      "(on the embedded CPU default, N engine processes)")


# ----------------------------------------------------------------------------- the plan (pure)
@dataclass(frozen=True, kw_only=True)
class Step:
    """One rollout of the schedule."""

    rollout_id: int
    generated_with: int
    """The engines' weight version when its generation starts: what its samples record."""
    trained_at: int
    """The version of the trainer's weights when it trains on it (rollout_id: one optimizer round per rollout)."""
    push_after: bool
    """After training on it the trainer pushes version rollout_id + 1 (first waiting for the next rollout)."""

    @property
    def staleness(self) -> int:
        return self.trained_at - self.generated_with


@dataclass(frozen=True, kw_only=True)
class OneStepOffPlan:
    start_rollout_id: int
    num_rollout: int
    update_weights_interval: int = 1
    start_version: int | None = None
    """The version the engines get at start: None, the trainer's (start_rollout_id); resuming from a checkpoint
    that kept the weights the engines held then (`served`), their older version."""

    @property
    def engines_at_start(self) -> int:
        return self.start_rollout_id if self.start_version is None else self.start_version

    @property
    def replays_push(self) -> bool:
        """Started from the engines' older weights: once rollout start_rollout_id is generated, the push the run
        that never stopped made after training rollout start_rollout_id - 1, if it was due."""
        return self.engines_at_start != self.start_rollout_id and self.push_due(self.start_rollout_id - 1)

    def push_due(self, rollout_id: int) -> bool:
        return (rollout_id + 1) % self.update_weights_interval == 0

    def steps(self) -> tuple[Step, ...]:
        engines = self.engines_at_start  # the push at start
        generated_with = {self.start_rollout_id: engines}
        if self.replays_push:
            engines = self.start_rollout_id
        steps = []
        for k in range(self.start_rollout_id, self.num_rollout):
            if k + 1 < self.num_rollout:
                generated_with[k + 1] = engines  # started before rollout k trains
            steps.append(Step(rollout_id=k, generated_with=generated_with[k], trained_at=k, push_after=self.push_due(k)))
            if self.push_due(k):
                engines = k + 1
        return tuple(steps)


def served_version_at_start(args) -> int | None:
    """The version of the engines' weights kept with the checkpoint this run resumes from (None: it resumes from
    none, or the checkpoint kept none: the engines start from the trainer's weights)."""
    from slime.checkpoint.contents import iteration_dir, latest_iteration, served_version

    last = latest_iteration(args.load) if args.load else None
    if last is None or args.finetune or args.start_rollout_id != last + 1:
        return None
    return served_version(iteration_dir(args.load, last))


# ----------------------------------------------------------------------------- running it
@dataclass
class _Generation:
    rollout_id: int
    watch: RolloutWatch
    version: int
    started: float
    result: Any = None
    finished: float | None = None


class AsyncSchedule:
    """Runs `OneStepOffPlan` on the rollout manager and the trainer group; train_async.py calls it in
    upstream's order (see the module docstring)."""

    def __init__(self, args, rollout, actors, metrics: MetricsLogger, critic=None) -> None:
        self.args = args
        self.critic = critic
        """The critic's ranks (--advantage-estimator ppo), or None."""
        self.plan = OneStepOffPlan(start_rollout_id=args.start_rollout_id, num_rollout=args.num_rollout,
                                   update_weights_interval=args.update_weights_interval,
                                   start_version=served_version_at_start(args))
        self.steps = {step.rollout_id: step for step in self.plan.steps()}
        self.rollout, self.actors, self.metrics = rollout, actors, metrics
        self.trainer_version = args.start_rollout_id
        """The version of the trainer's weights: one more per rollout trained."""
        self.engine_version: int | None = None
        """What the engines hold (None before the push at start)."""
        self._generation: _Generation | None = None
        self._finished: dict[int, _Generation] = {}
        self._generated_with: dict[int, int] = {}
        rollout.attach_trainer(lambda urls, version: catch_up(actors, metrics, urls, version))
        rollout.targets.trainer_version = lambda: self.trainer_version

    def push_due(self, rollout_id: int) -> bool:
        return self.steps[rollout_id].push_after

    # -- generation ------------------------------------------------------------------------------
    def start_generation(self, rollout_id: int) -> None:
        if self._generation is not None:
            raise RuntimeError(f"rollout {rollout_id} starts while rollout {self._generation.rollout_id} generates")
        expected = self.steps[rollout_id].generated_with
        if self.engine_version != expected:  # the plan and the run disagree: a bug, never a sample mislabelled
            raise RuntimeError(f"rollout {rollout_id} would generate with version {self.engine_version}, "
                               f"the schedule says {expected}")
        self._generation = _Generation(rollout_id, self.rollout.start_generate(rollout_id), self.engine_version,
                                       time.monotonic())

    def collect(self, rollout_id: int):
        """The trainer's data of rollout `rollout_id` (waits for its generation)."""
        generation = self._finished.pop(rollout_id, None) or self._finish_generation()
        if generation.rollout_id != rollout_id:
            raise RuntimeError(f"collected rollout {generation.rollout_id}, expected {rollout_id}")
        data_ref, metrics = generation.result
        log_unless_custom(self.metrics, "rollout", rollout_id, metrics)
        # what its samples report (a restarted engine caught up meanwhile serves a newer version; a background
        # generator's groups may be older); without the metrics (a custom log function), the schedule's word
        self._generated_with[rollout_id] = int(metrics.get("rollout/weight_version_min", generation.version))
        return data_ref

    def _finish_generation(self) -> _Generation:
        """Wait for the rollout in flight (its own deadline); the trainer is free, so catch-ups run."""
        generation, self._generation = self._generation, None
        if generation is None:
            raise RuntimeError("no rollout is generating")
        if generation.result is None:
            generation.result = self.rollout.collect(generation.watch)
            generation.finished = generation.finished or time.monotonic()
        return generation

    def _watch_generation(self) -> None:
        """Between the trainer's polls: the rollout in flight fails loudly; restarted engines wait."""
        generation = self._generation
        if generation is None or generation.finished is not None:
            return
        if generation.watch.poll(0.0, can_push=False):
            generation.finished = time.monotonic()

    # -- training and pushing --------------------------------------------------------------------
    def train(self, rollout_id: int, data_ref) -> None:
        step = self.steps[rollout_id]
        logger.info("Timer actor_train start (rollout %d, generated with version %d, trainer at %d)", rollout_id,
                    step.generated_with, self.trainer_version)
        # ppo: the critic's values and step first (--num-critic-only-steps: the actor's weights stay, and the
        # pushes of the schedule carry them unchanged)
        result = train_rollout(self.args, rollout_id, data_ref, self.actors, self.critic,
                               on_poll=self._watch_generation)
        self.trainer_version = rollout_id + 1
        generated_with = self._generated_with.pop(rollout_id, step.generated_with)
        # train_rollout_logprob_abs_diff compares the engines' log-probs of `generated_with` with the trainer's
        # of `trained_at`: near zero only where the two are the same version
        self.metrics.log("train", rollout_id, {**result, "train/trainer_weight_version": float(step.trained_at),
                                               "train/rollout_weight_version": float(generated_with),
                                               "train/weight_staleness": float(step.trained_at - generated_with)})
        self._catch_up_waiting()

    def _catch_up_waiting(self) -> None:
        generation = self._generation
        if generation is not None and generation.finished is None and generation.watch.waiting_for_weights:
            generation.watch.poll(0.0, can_push=True)

    def push_at_start(self) -> None:
        """The engines' first weights: the trainer's (version start_rollout_id), or, resuming a checkpoint that
        kept the weights the engines held then, those (their version)."""
        version, start = self.plan.engines_at_start, self.plan.start_rollout_id
        never_stopped = OneStepOffPlan(start_rollout_id=0, num_rollout=start + 1,
                                       update_weights_interval=self.plan.update_weights_interval).steps()[start]
        if self.args.load and version != never_stopped.generated_with:
            logger.warning("resuming at rollout %d without the engines' weights of that time (the checkpoint kept "
                           "none: saved by train.py, or by an older version): rollout %d generates with version %d, "
                           "a run that had not stopped generated it with version %d, so from it on the samples "
                           "differ from that run's", start, start, version, never_stopped.generated_with)
        if version == self.trainer_version:
            self.push_weights(version - 1)
        else:
            logger.info("resuming with the engines' weights of the checkpoint (version %d): rollout %d generates "
                        "with them, as it did before the run stopped", version, self.plan.start_rollout_id)
            self._push(version, served=True)

    def replay_push(self) -> None:
        """After the first rollout generated with the checkpoint's engine weights: the push that followed it."""
        if self.plan.replays_push:
            self.push_weights(self.plan.start_rollout_id - 1)

    def push_weights(self, rollout_id: int) -> None:
        """Fenced weight push of version rollout_id + 1 (after training rollout_id; rollout_id = start - 1 at start)."""
        if self.trainer_version != rollout_id + 1:
            raise RuntimeError(f"push of version {rollout_id + 1} from a trainer at version {self.trainer_version}")
        self._push(rollout_id + 1, served=False)

    def _push(self, version: int, *, served: bool) -> None:
        if self._generation is not None:  # upstream: never push in the middle of a rollout's generation
            generation = self._finish_generation()
            self._finished[generation.rollout_id] = generation
        held = self.rollout.hold_generation()  # a background generator's requests (fully-async rollout)
        try:
            engine_urls = self.rollout.engines_for_sync()
            result = self.actors.update_weights(version - 1, engine_urls=engine_urls, served=served,
                                                keep_served=None if served else self._saves_before_next_push(version))
            self.rollout.weights_pushed(engine_urls, version)
        finally:
            self.rollout.release_generation()
        self.engine_version = version
        self.metrics.log("weight_sync", version - 1, {**result, **held})

    def _saves_before_next_push(self, version: int) -> bool:
        """A checkpoint is saved while the engines hold `version` (it then keeps a copy of those weights)."""
        if not self.args.save:
            return False
        for rollout_id in range(max(version, self.plan.start_rollout_id), self.args.num_rollout):
            if save_due(self.args, rollout_id):
                return True
            if self.plan.push_due(rollout_id):
                return False
        return False

    def evaluate(self, rollout_id: int) -> dict:
        """Eval with the engines' current weights, once the rollout in flight has been generated."""
        if self._generation is not None:
            generation = self._finish_generation()
            self._finished[generation.rollout_id] = generation
        return self.rollout.evaluate(rollout_id)
