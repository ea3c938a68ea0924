"""The driver's proxy of the rollout manager: it starts the manager's Ray actor and makes every call on it
wait with a deadline (slime/utils/deadlines.py: each wait named after what waits). A rollout or an eval
in flight is waited on by `RolloutWatch` (slime/ray/driver/rollout_wait.py), which also brings engines
restarted meanwhile to the trainer's weights.

The engines' Ray actors are the driver's, handed to the manager (Ray ends the actors an actor created when it
ends): after a failure of the trainer alone, a restart (slime/ray/driver/healing.py) ends the manager and its
router but keeps the engines serving (`KeptEngines`), and the next session's manager adopts them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from slime.config.run_state import actor_args, run_state_of
from slime.ray.driver.cluster import retry_if_cancelled_before_start, worker_env
from slime.ray.driver.placement import Placement
from slime.ray.driver.rollout_wait import EngineTargets, RolloutWatch, get_result, wait_for_rollout
from slime.ray.engines.actor import EngineEndpoint
from slime.ray.rollout_manager.manager import RolloutManager, engine_log_dir
from slime.utils.deadlines import (
    ENGINE_CONTROL_CALL_S,
    ROLLOUT_MANAGER_SHUTDOWN_S,
    engines_for_sync_s,
    hold_generation_s,
    rollout_driver_margin_s,
    rollout_manager_startup_s,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeptEngines:
    """Engines a failed session left serving for the next one (a trainer-side heal)."""

    actors: tuple
    """Their Ray actors (EngineRayActor), per engine in rank order, one per node of the engine."""
    released: tuple[str, ...]
    """The memory tags they have released (colocate: the trainer had the devices when it failed)."""

    def stop(self) -> None:
        _stop_engine_actors([actor for parts in self.actors for actor in parts])


class RolloutManagerHandle:
    """Driver-side proxy: each call waits on the Ray actor with a deadline."""

    def __init__(self, actor, args, engine_actors: list[list] | None = None):
        self._actor = actor
        self._engine_actors = [list(parts) for parts in engine_actors or ()]
        self._margin_s = rollout_driver_margin_s(args)
        self.targets = EngineTargets()
        """What the trainer's pushes reach; `targets.push` is set once a trainer exists."""

    def _get(self, ref, what: str, timeout_s: float | None):
        return get_result(ref, timeout_s=timeout_s, what=what)

    def wait_ready(self) -> None:
        self._get(self._actor.engine_urls.remote(), "start engines", rollout_manager_startup_s())

    def engine_urls(self) -> list[str]:
        return self._get(self._actor.engine_urls.remote(), "engine_urls", ENGINE_CONTROL_CALL_S)

    def engine_endpoints(self) -> list[EngineEndpoint]:
        return self._get(self._actor.engine_endpoints.remote(), "engine_endpoints", ENGINE_CONTROL_CALL_S)

    def num_prompts(self) -> int:
        return self._get(self._actor.num_prompts.remote(), "num_prompts", ENGINE_CONTROL_CALL_S)

    def generate(self, rollout_id: int) -> tuple[ray.ObjectRef, dict[str, Any]]:
        return self.collect(self.start_generate(rollout_id))

    def start_generate(self, rollout_id: int) -> RolloutWatch:
        """Start a rollout without waiting for it (train_async.py trains meanwhile)."""
        logger.info("rollout %d: generating", rollout_id)
        ref = self._actor.generate.remote(rollout_id, self._version())
        return RolloutWatch(self._actor, ref, what="generate", margin_s=self._margin_s, targets=self.targets)

    @staticmethod
    def collect(watch: RolloutWatch) -> tuple[ray.ObjectRef, dict[str, Any]]:
        refs, metrics = watch.result()
        return refs[0], metrics

    def hold_generation(self) -> dict[str, float]:
        return self._get(self._actor.hold_generation.remote(), "hold generation", hold_generation_s())

    def release_generation(self) -> None:
        self._get(self._actor.release_generation.remote(), "release generation", ENGINE_CONTROL_CALL_S)

    def evaluate(self, rollout_id: int) -> dict[str, Any]:
        ref = self._actor.evaluate.remote(rollout_id, self._version())
        return wait_for_rollout(self._actor, ref, what="eval", margin_s=self._margin_s, targets=self.targets)

    def attach_trainer(self, push) -> None:
        """push(engine_urls, version) -> metrics: how restarted engines get the trainer's current weights."""
        self.targets.push = push
        self.targets.urls = tuple(self.engine_urls())  # what the trainer was built aiming at

    def _version(self) -> str | None:
        return None if self.targets.version is None else str(self.targets.version)

    def engines_for_sync(self) -> list[str] | None:
        """The engine list to aim the next weight sync at when it changed since the last push, else None."""
        current = self._get(self._actor.engines_for_sync.remote(), "engines for the weight sync",
                            engines_for_sync_s())
        return self.targets.for_sync(current)

    def weights_pushed(self, urls: list[str] | None, version: int) -> None:
        """A sync reached every engine: restarted ones that waited for weights may serve now."""
        self.targets.pushed(urls if urls is not None else list(self.targets.urls), version)
        self._get(self._actor.engines_caught_up.remote(list(self.targets.urls), str(version)),
                  "engines caught up", ENGINE_CONTROL_CALL_S)

    def offload(self) -> dict[str, float]:
        return self._get(self._actor.offload.remote(), "offload engines", ENGINE_CONTROL_CALL_S)

    def onload(self, tags: tuple[str, ...] | None) -> None:
        self._get(self._actor.onload.remote(tags), f"onload engines {tags or 'all'}", ENGINE_CONTROL_CALL_S)

    def shutdown(self) -> None:
        try:
            self._get(self._actor.shutdown.remote(), "shutdown", ROLLOUT_MANAGER_SHUTDOWN_S)
        finally:
            ray.kill(self._actor, no_restart=True)
            for parts in self._engine_actors:  # stopped by the manager (bounded); gone with it if it could not
                _kill_all(parts)

    def keep_engines(self) -> KeptEngines | None:
        """End the manager and its router but leave the engines serving, for the next session's manager (a
        trainer-side heal); None, with nothing ended, when an engine is not serving (the session then stops
        them all)."""
        released = self._get(self._actor.detach_engines.remote(), "hand the engines over", ENGINE_CONTROL_CALL_S)
        if released is None:
            return None
        ray.kill(self._actor, no_restart=True)
        return KeptEngines(actors=tuple(tuple(parts) for parts in self._engine_actors), released=tuple(released))


def _stop_engine_actors(actors: list, timeout_s: float = ROLLOUT_MANAGER_SHUTDOWN_S) -> None:
    stops = [actor.stop.remote() for actor in actors]
    ray.wait(stops, num_returns=len(stops), timeout=timeout_s)
    for actor in actors:
        ray.kill(actor, no_restart=True)


def create_rollout_manager(args, placement: Placement, kept: KeptEngines | None = None) -> RolloutManagerHandle:
    """The rollout manager, with new engines on the placement's engine bundles, or adopting `kept` ones."""
    # The manager drives HTTP and the router; it reserves no device. It runs on the driver's node:
    # the data paths parse_args checked there are the ones it reads. Threaded, so the driver can poll
    # a rollout's status while it generates (RolloutManager.rollout_status).
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    manager = ray.remote(num_cpus=0, max_concurrency=4)(RolloutManager).options(
        scheduling_strategy=here, runtime_env={"env_vars": worker_env(placement.use_gpu)})

    def start() -> RolloutManagerHandle:
        engines = [list(parts) for parts in kept.actors] if kept is not None else new_engine_actors(args, placement)
        released = kept.released if kept is not None else None
        handle = RolloutManagerHandle(manager.remote(actor_args(args), run_state_of(args), placement.layout.engines,
                                                     engines, released), args, engines)
        try:
            handle.wait_ready()
        except BaseException:  # kept engines stay the session's to stop
            _kill_all([handle._actor, *(actor for parts in engines for actor in parts if kept is None)])
            raise
        return handle

    return retry_if_cancelled_before_start(start, "the rollout manager")


def new_engine_actors(args, placement: Placement) -> list[list]:
    """Per engine slot, one EngineRayActor per node of the engine, on that node's first bundle (started by the
    manager)."""
    from slime.config.engine import pick_rollout_backend
    from slime.ray.engines.actor import EngineRayActor

    state = run_state_of(args)
    backend, log_dir, engine_args = pick_rollout_backend(args), engine_log_dir(state.ledger_dir), actor_args(args)
    remote = ray.remote(EngineRayActor)
    return [[remote.options(**placement.engine_options(slot.rank, part.node_rank)).remote(
        engine_args, state, part, backend, log_dir) for part in slot.parts] for slot in placement.layout.engines]


def _kill_all(actors: list) -> None:
    for actor in actors:
        ray.kill(actor, no_restart=True)
