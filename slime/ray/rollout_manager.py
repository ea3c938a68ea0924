"""The rollout side: engines, the router, the data source and the rollout function.

`RolloutManager` is one Ray actor on the driver's node (where the user's data paths were
checked). It starts one engine per `--rollout-num-gpus-per-engine` devices (real SGLang servers
on GPUs, the embedded engine elsewhere: both answer the same HTTP API), each through an
`EngineRayActor` on the engine's own bundles, so on their node and GPUs; puts a router in front;
and turns each rollout into the trainer's batch. The driver talks to it through
`RolloutManagerHandle`, whose calls all carry a deadline.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from slime.backends.sglang_utils.http_client import SGLangHTTPClient
from slime.backends.sglang_utils.launcher import pick_rollout_backend
from slime.ray.engine_actor import EngineEndpoint, EngineRayActor
from slime.ray.cluster import advertised_host, node_address, worker_env
from slime.ray.placement import EngineSlot, Placement
from slime.rollout.advantages import samples_to_train_data
from slime.rollout.base_types import call_rollout_fn
from slime.rollout.data_source import RolloutDataSource
from slime.rollout.metrics import compute_rollout_metrics
from slime.router.router import launch_router
from slime.utils.misc import load_function
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

# Engine-control calls (release/resume memory, flush) are quick; generation is bounded by the
# per-request HTTP timeout of the rollout function, not here.
CONTROL_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 900.0


class RolloutManager:
    def __init__(self, args, placement: Placement):
        self.args = args
        self.data_source = RolloutDataSource(args)
        if args.start_rollout_id > 0:  # resume after the rollout whose data position was saved
            self.data_source.load(args.start_rollout_id - 1)
        self.backend = pick_rollout_backend(args)
        self._engine_actors: list = []
        self.engines: list[EngineEndpoint] = self._launch_engines(placement)
        self.router = self._launch_router() if self.engines else None
        self._rollout_fn = load_function(args.rollout_function_path)

    def _launch_engines(self, placement: Placement) -> list[EngineEndpoint]:
        slots = placement.layout.engines
        if not slots:
            return []
        log_dir = os.path.join(self.args.ledger_dir or "/tmp", "engine-logs")
        logger.info("starting %d %s engine(s) for %s", len(slots), self.backend, self.args.hf_checkpoint)
        remote = ray.remote(EngineRayActor)
        self._engine_actors = [remote.options(**placement.engine_options(slot.rank)).remote(
            self.args, slot, self.backend, log_dir) for slot in slots]
        refs = [actor.start.remote(STARTUP_TIMEOUT_S) for actor in self._engine_actors]
        try:  # each engine bounds its own start-up; this bounds Ray scheduling the actors as well
            return wait_engines(refs, slots, timeout_s=STARTUP_TIMEOUT_S + 120)
        except Exception:
            self._stop_engines()
            raise

    def _launch_router(self):
        # Upstream binds the router to its node's address; --sglang-router-ip overrides (0.0.0.0: every
        # interface). The rollout function then reaches it at the address other nodes would use too.
        self.args.sglang_router_ip = self.args.sglang_router_ip or node_address()
        router = _retry_port_clash(lambda: launch_router(self.args, [e.url for e in self.engines]))
        self.args.sglang_router_ip, self.args.sglang_router_port = advertised_host(router.host), router.port
        return router

    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def engine_endpoints(self) -> list[EngineEndpoint]:
        return list(self.engines)

    def num_prompts(self) -> int:
        return len(self.data_source)

    def generate(self, rollout_id: int) -> tuple[list[ray.ObjectRef], dict[str, Any]]:
        samples, metrics = self._samples(rollout_id)
        if self.args.save_debug_rollout_data:
            path = self.args.save_debug_rollout_data.format(rollout_id=rollout_id)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.save({"rollout_id": rollout_id, "samples": [s.to_dict() for s in samples]}, path)
        data = samples_to_train_data(self.args, samples)
        metrics = {**compute_rollout_metrics(self.args, samples), **(metrics or {})}
        if self.args.save:
            self.data_source.save(rollout_id)
        return [ray.put(data)], {f"rollout/{k}" if "/" not in k else k: v for k, v in metrics.items()}

    def _samples(self, rollout_id: int) -> tuple[list[Sample], dict[str, Any]]:
        if self.args.load_debug_rollout_data:
            path = self.args.load_debug_rollout_data.format(rollout_id=rollout_id)
            saved = torch.load(path, weights_only=False)
            return [Sample.from_dict(d) for d in saved["samples"]], {}
        output = call_rollout_fn(self._rollout_fn, self.args, rollout_id, self.data_source, evaluation=False)
        return [s for group in output.samples for s in group], dict(output.metrics or {})

    def evaluate(self, rollout_id: int) -> dict[str, Any]:
        fn = load_function(self.args.eval_function_path or self.args.rollout_function_path)
        output = call_rollout_fn(fn, self.args, rollout_id, self.data_source, evaluation=True)
        return dict(output.metrics or {})

    def offload(self) -> dict[str, float]:
        """Colocate: engines give all their memory (weights, KV cache, CUDA graphs) to the trainer.
        Returns each engine's device memory before and after the release."""
        before = self._each_engine(lambda c: c.server_info())
        self._each_engine(lambda c: c.release_memory_occupation())
        after = self._each_engine(lambda c: c.server_info())
        return engine_memory_metrics(before, after)

    def onload(self, tags: tuple[str, ...] | None) -> None:
        """Resume the given memory tags (None: every tag still released)."""
        self._each_engine(lambda c: c.resume_memory_occupation(list(tags) if tags else None))

    def _each_engine(self, call) -> list:
        with ThreadPoolExecutor(max_workers=max(1, len(self.engines))) as pool:
            return list(pool.map(lambda e: call(SGLangHTTPClient(e.url)), self.engines))

    def shutdown(self) -> None:
        if self.router is not None:
            self.router.stop()
        self._stop_engines()

    def _stop_engines(self, timeout_s: float = 60.0) -> None:
        stops = [actor.stop.remote() for actor in self._engine_actors]
        ray.wait(stops, num_returns=len(stops), timeout=timeout_s)
        for actor in self._engine_actors:
            ray.kill(actor, no_restart=True)


def wait_engines(refs: list, slots: Sequence[EngineSlot], *, timeout_s: float) -> list[EngineEndpoint]:
    """The engines' endpoints in rank order; the first engine that fails, or the deadline, raises naming
    the engines and their nodes."""
    pending = dict(zip(refs, slots))
    deadline = time.monotonic() + timeout_s
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise TimeoutError(f"engines did not start within {timeout_s:.0f}s: {_describe(pending.values())}")
        slot = pending.pop(done[0])
        try:
            ray.get(done[0])
        except Exception as exc:
            raise RuntimeError(f"engine failed to start: {_describe([slot])}: {exc}") from exc
    return ray.get(refs)


def _describe(slots: Iterable[EngineSlot]) -> str:
    return "; ".join(f"engine {s.rank} on node {s.node_ip} ({s.node_id[:8]}), gpus {list(s.gpu_ids)}" for s in slots)


def engine_memory_metrics(before: list[dict], after: list[dict]) -> dict[str, float]:
    """Per engine: device memory while awake (peak since its last resume) and after the release.
    Engines that do not report memory (`memory` missing from their server info) are left out."""
    metrics: dict[str, float] = {}
    for index, (awake, released) in enumerate(zip(before, after)):
        if "memory" not in awake or "memory" not in released:
            continue
        for key, value in awake["memory"].items():
            metrics[f"memory/engine{index}_awake_{key}"] = float(value)
        for key, value in released["memory"].items():
            metrics[f"memory/engine{index}_released_{key}"] = float(value)
    return metrics


def _retry_port_clash(launch, attempts: int = 3):
    """A free port can be taken by another process between choosing it and binding it: retry."""
    for attempt in range(attempts):
        try:
            return launch()
        except RuntimeError as exc:
            if "address already in use" not in str(exc) or attempt == attempts - 1:
                raise
            logger.warning("port clash while starting a server; retrying with another port")


class RolloutManagerHandle:
    """Driver-side proxy: each call waits on the Ray actor with a deadline."""

    def __init__(self, actor):
        self._actor = actor

    def _get(self, ref, what: str, timeout_s: float | None):
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"rollout manager: '{what}' did not finish within {timeout_s:.0f}s") from exc

    def wait_ready(self) -> None:
        self._get(self._actor.engine_urls.remote(), "start engines", STARTUP_TIMEOUT_S + 180)

    def engine_urls(self) -> list[str]:
        return self._get(self._actor.engine_urls.remote(), "engine_urls", CONTROL_TIMEOUT_S)

    def engine_endpoints(self) -> list[EngineEndpoint]:
        return self._get(self._actor.engine_endpoints.remote(), "engine_endpoints", CONTROL_TIMEOUT_S)

    def num_prompts(self) -> int:
        return self._get(self._actor.num_prompts.remote(), "num_prompts", CONTROL_TIMEOUT_S)

    def generate(self, rollout_id: int) -> tuple[ray.ObjectRef, dict[str, Any]]:
        # Generation time grows with the rollout; each HTTP request inside carries its own timeout.
        refs, metrics = self._get(self._actor.generate.remote(rollout_id), "generate", None)
        return refs[0], metrics

    def evaluate(self, rollout_id: int) -> dict[str, Any]:
        return self._get(self._actor.evaluate.remote(rollout_id), "eval", None)

    def offload(self) -> dict[str, float]:
        return self._get(self._actor.offload.remote(), "offload engines", CONTROL_TIMEOUT_S)

    def onload(self, tags: tuple[str, ...] | None) -> None:
        self._get(self._actor.onload.remote(tags), f"onload engines {tags or 'all'}", CONTROL_TIMEOUT_S)

    def shutdown(self) -> None:
        try:
            self._get(self._actor.shutdown.remote(), "shutdown", 60)
        finally:
            ray.kill(self._actor, no_restart=True)


def create_rollout_manager(args, placement: Placement) -> RolloutManagerHandle:
    # The manager drives HTTP and the router; it reserves no device. It runs on the driver's node:
    # the data paths parse_args checked there are the ones it reads.
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(num_cpus=0)(RolloutManager).options(
        scheduling_strategy=here, runtime_env={"env_vars": worker_env(placement.use_gpu)}).remote(args, placement)
    handle = RolloutManagerHandle(actor)
    handle.wait_ready()
    return handle
