"""The rollout side: engines, the router, the data source and the rollout function.

`RolloutManager` is one Ray actor on the driver's node (where the user's data paths were
checked). It starts one engine per `--rollout-num-gpus-per-engine` devices (real SGLang servers
on GPUs, the embedded engine elsewhere: both answer the same HTTP API), each through an
`EngineRayActor` the driver made on the engine's own bundles, so on their node and GPUs (an engine over
several nodes: one actor and SGLang process per node, seen as one engine at node rank 0's URL), or adopts
engines a trainer-side restart kept serving; puts a router in front; and turns each rollout into the
trainer's batch. The driver talks to it through
`RolloutManagerHandle` (slime/ray/driver/rollout_handle.py), whose calls all carry a deadline.

Every rollout and eval runs under `RolloutGuard` (--rollout-timeout, engine health, fault
tolerance: slime/ray/rollout_manager/guard.py); the engines' states live in `EngineFleet`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import ray
import torch

from slime.backends.sglang_utils.http_client import SGLangHTTPClient
from slime.backends.sglang_utils.launcher import pick_rollout_backend
from slime.distributed.fault_inject import maybe_kill_run
from slime.config.run_config import run_config_of, run_health
from slime.config.run_state import RunState, publish
from slime.ray.common.engine_slot import EngineSlot
from slime.ray.common.node import advertised_host, serving_host
from slime.backends.sglang_utils.launcher import EngineNodes
from slime.ray.engines.actor import EngineEndpoint, RemoteEngine, SpanningEngine
from slime.ray.engines.recovery import EngineFleet
from slime.ray.rollout_manager.guard import RolloutGuard
from slime.ray.rollout_manager.errors import RolloutTimeoutError, portable_rollout_errors
from slime.ray.rollout_manager.steps import RolloutSteps
from slime.rollout import generation_gate
from slime.rollout.train_data import flatten_groups, samples_to_train_data
from slime.rollout.base_types import call_rollout_fn
from slime.rollout.data_source import eval_prompt_specs, read_rows
from slime.rollout.metrics import compute_rollout_metrics
from slime.rollout.staleness import version_metrics
from slime.router.router import launch_router
from slime.router.workers import RouterWorkers
from slime.utils.deadlines import (
    ENGINE_CONTROL_CALL_S,
    ENGINE_STARTUP_S,
    ROLLOUT_MANAGER_SHUTDOWN_S,
    engine_restart_call_s,
    engines_startup_s,
    rollout_deadline_s,
    rollout_step_window_s,
)
from slime.utils.http_utils import outstanding_requests
from slime.utils.misc import load_function
from slime.utils.rollout_batch import REQUIRED_KEYS
from slime.utils.security import use_key
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

HOLD_POLL_S = 0.1
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's memory tags (release and resume of no tags mean all of them)."""


class RolloutManager:
    def __init__(self, args, run_state: RunState, engine_slots: Sequence[EngineSlot], engine_actors: Sequence = (),
                 kept_released: Sequence[str] | None = None):
        """`run_state`: the driver's when it started this manager (where the run resumes, its ledger dir, whether it
        spans nodes; the manager adds the router's address); `engine_slots`: where the driver placed each engine;
        `engine_actors`: per engine slot, the driver's
        EngineRayActors (one per node); started here, or, with `kept_released` (the memory tags they hold
        released), already serving: a trainer-side heal kept them."""
        from slime.utils.logging_utils import configure_logger

        configure_logger(role="rollout manager")  # engine failures and restarts reach the driver's output
        use_key(args.api_key)  # the router inherits it; every call to an engine or the router sends it
        self.args = args
        self.run_state = run_state
        publish(args, run_state)  # the plug-ins this process calls read the state's facts on args
        self.data_source = load_function(args.data_source_path)(args)  # --data-source-path: cls(args)
        self.backend = pick_rollout_backend(args)
        self.log_dir = engine_log_dir(run_state.ledger_dir)
        self._engine_actors: list[list] = [list(parts) for parts in engine_actors]
        """Per engine, the driver's actors, one per node (node rank 0 first)."""
        self._part_endpoints: list[list[EngineEndpoint]] = []  # the same, their processes' endpoints
        self.released: set[str] = set(kept_released or ())
        """The memory tags the engines have released (offload and onload change only what they must: SGLang
        refuses to resume a tag it holds)."""
        self.engines: list[EngineEndpoint] = (  # node rank 0's: the engines' URLs
            self._launch_engines(engine_slots) if kept_released is None else self._adopt_engines(engine_slots))
        self.router = self._launch_router() if self.engines else None
        health = run_health(args)
        self.fleet = EngineFleet([self._engine_process(rank) for rank in range(len(self.engines))],
                                 relaunch=self._restart_engine, fault_tolerant=health.fault_tolerant,
                                 router=RouterWorkers(kind=self.router.kind, url=self.router.url) if self.router else None)
        self.guard = RolloutGuard(health, self.fleet)
        self.steps = RolloutSteps(rollout_step_window_s(args))
        self._rollout_fn = load_function(args.rollout_function_path)
        if run_state.start_rollout_id > 0:  # resume after the rollout whose data state was saved; last, so that
            self.data_source.load(run_state.start_rollout_id - 1)  # the restored RNG is this process's at rollout start

    def _launch_engines(self, slots: Sequence[EngineSlot]) -> list[EngineEndpoint]:
        if not slots:
            return []
        logger.info("starting %d %s engine(s) for %s", len(slots), self.backend, self.args.hf_checkpoint)
        try:  # each engine bounds its own start-up; this bounds Ray scheduling the actors as well
            deadline = time.monotonic() + engines_startup_s()
            nodes = engine_nodes_of(self._engine_actors, timeout_s=engines_startup_s())
            refs = [actor.start.remote(ENGINE_STARTUP_S, where) for actors, spec in zip(self._engine_actors, nodes)
                    for actor, where in zip(actors, spec)]
            started = wait_engines(refs, [part for slot in slots for part in slot.parts],
                                   timeout_s=max(0.0, deadline - time.monotonic()))
        except Exception:
            self._stop_engines()
            raise
        self._split_endpoints(slots, started)
        return [parts[0] for parts in self._part_endpoints]

    def _split_endpoints(self, slots, started: list[EngineEndpoint]) -> None:
        """Every process's endpoint, in slot and node order, grouped by engine."""
        for slot in slots:
            self._part_endpoints.append(started[:slot.nnodes])
            started = started[slot.nnodes:]

    def _engine_process(self, rank: int):
        """The fleet's handle on engine `rank`: its one process, or its processes over several nodes as one."""
        parts = [RemoteEngine(actor, endpoint)
                 for actor, endpoint in zip(self._engine_actors[rank], self._part_endpoints[rank])]
        return parts[0] if len(parts) == 1 else SpanningEngine(parts)

    def _adopt_engines(self, slots: Sequence[EngineSlot]) -> list[EngineEndpoint]:
        """Engines a trainer-side heal kept: each process must still serve where it did."""
        logger.info("keeping %d %s engine(s) through the restart (released: %s)", len(slots), self.backend,
                    sorted(self.released) or "nothing")
        refs = [actor.serving_endpoint.remote() for actors in self._engine_actors for actor in actors]
        self._split_endpoints(slots, wait_engines(refs, [part for slot in slots for part in slot.parts],
                                                  timeout_s=ENGINE_CONTROL_CALL_S))
        return [parts[0] for parts in self._part_endpoints]

    def detach_engines(self) -> list[str] | None:
        """Hand the engines to the next session's manager (a restart after the trainer alone failed): requests
        still running are aborted, the health monitor and the router stop, the engines keep serving. Returns the
        memory tags they have released; None, with nothing stopped, when an engine is not serving or does not
        answer."""
        self.fleet.check_processes()
        if self.fleet.fatal is not None or len(self.fleet.serving()) != len(self.fleet.slots):
            return None
        try:
            if not all(self._each_engine(lambda c: c.health())):
                return None
            self._each_engine(lambda c: c.abort_all())
        except Exception:  # noqa: BLE001 - an engine that does not answer is not kept
            logger.warning("an engine did not answer: the restart starts new engines", exc_info=True)
            return None
        self.guard.monitor.close()
        if self.router is not None:
            self.router.stop()
        return sorted(self.released)

    def _restart_engine(self, rank: int):
        """A failed engine, again on its own bundles, on a new port (EngineFleet's relaunch); over several nodes,
        every node's process, meeting at a new address."""
        actors = self._engine_actors[rank]
        (nodes,) = engine_nodes_of([actors], timeout_s=engine_restart_call_s())
        refs = [actor.restart.remote(ENGINE_STARTUP_S, where) for actor, where in zip(actors, nodes)]
        self._part_endpoints[rank] = ray.get(refs, timeout=engine_restart_call_s())
        self.engines[rank] = self._part_endpoints[rank][0]
        return self._engine_process(rank)

    def _launch_router(self):
        # Loopback on one node; upstream's node address when the run spans nodes; --sglang-router-ip
        # overrides (0.0.0.0: every interface). The rollout function reaches it at the advertised address.
        state = self.run_state
        router = launch_router(self.args, [e.url for e in self.engines], host=state.router_ip or serving_host(
            state.spans_nodes), port=state.router_port, log_dir=self.log_dir)
        self.run_state = dataclasses.replace(state, router_ip=advertised_host(router.host), router_port=router.port)
        publish(self.args, self.run_state)
        return router

    def engine_urls(self) -> list[str]:
        return self.fleet.urls()

    def engine_endpoints(self) -> list[EngineEndpoint]:
        """Every engine process's endpoint (an engine over several nodes: one per node, node rank 0 first)."""
        return [endpoint for parts in self._part_endpoints for endpoint in parts]

    def num_prompts(self) -> int:
        return len(self.data_source)

    @portable_rollout_errors
    def generate(self, rollout_id: int, weights_version: str | None = None
                 ) -> tuple[list[ray.ObjectRef], dict[str, Any]]:
        """One rollout as the trainer's batch, and its metrics ({} when a custom log function took over).
        `weights_version`: what the engines hold (a restarted engine must reach it before serving).
        Every step after the guarded generation has its window (RolloutSteps)."""
        with self.steps.call():
            start = time.monotonic()
            (samples, metrics), faults = self.steps.guarded(lambda: self.guard.run(
                "generate", rollout_id, lambda: self._samples(rollout_id),
                budget_s=rollout_deadline_s(self.args, run_config_of(self.args)),
                weights_version=weights_version, inject_faults=True))
            rollout_time = time.monotonic() - start
            if run_health(self.args).fault_tolerant:
                metrics = {**(metrics or {}), **faults}
            label = f"rollout {rollout_id}:"
            if self.args.save_debug_rollout_data:
                self.steps.run(f"{label} --save-debug-rollout-data", self._save_debug_rollout, rollout_id, samples)
            data = self.steps.run(f"{label} the conversion to train data", self._train_data, samples)
            if self.args.save:
                self.steps.run(f"{label} the data-source save", self.data_source.save, rollout_id)
            log_path = self.args.custom_rollout_log_function_path
            if log_path and self.steps.run(f"{label} --custom-rollout-log-function-path {log_path}",
                                           _call_rollout_log, log_path, rollout_id, self.args, samples, metrics,
                                           rollout_time):
                return [ray.put(data)], {}
            metrics = {**self.steps.run(f"{label} the rollout metrics", compute_rollout_metrics, self.args, samples),
                       **version_metrics(samples), **(metrics or {}), "perf/rollout_generate_s": rollout_time}
            return [ray.put(data)], {f"rollout/{k}" if "/" not in k else k: v for k, v in metrics.items()}

    def _save_debug_rollout(self, rollout_id: int, samples: list[Sample]) -> None:
        path = self.args.save_debug_rollout_data.format(rollout_id=rollout_id)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save({"rollout_id": rollout_id, "samples": [s.to_dict() for s in samples]}, path)

    def _samples(self, rollout_id: int) -> tuple[list[Sample], dict[str, Any]]:
        if self.args.load_debug_rollout_data:
            path = self.args.load_debug_rollout_data.format(rollout_id=rollout_id)
            saved = load_debug_rollout(path)
            return [Sample.from_dict(d) for d in saved["samples"]], {}
        if hasattr(self.data_source, "rollout_id"):  # what --buffer-filter-path receives
            self.data_source.rollout_id = rollout_id
        maybe_kill_run("kill_during_rollout", 0, rollout_id)
        output = call_rollout_fn(self._rollout_fn, self.args, rollout_id, self.data_source, evaluation=False)
        return flatten_groups(output.samples), dict(output.metrics or {})

    def _train_data(self, samples: list[Sample]) -> dict[str, list]:
        """--custom-convert-samples-to-train-data-path `fn(args, samples) -> dict`, else the default conversion."""
        path = self.args.custom_convert_samples_to_train_data_path
        if not path:
            return samples_to_train_data(self.args, samples)
        data = load_function(path)(self.args, samples)
        check_train_data(data, path)
        return data

    @portable_rollout_errors
    def evaluate(self, rollout_id: int, weights_version: str | None = None) -> dict[str, Any]:
        """Eval metrics ({} when --custom-eval-rollout-log-function-path took over the logging)."""
        with self.steps.call():
            label = f"eval {rollout_id}:"
            fn = self.steps.run(f"{label} loading the eval function", load_function,
                                self.args.eval_function_path or self.args.rollout_function_path)
            prompts = self.steps.run(f"{label} counting the eval prompts", self._eval_prompts)
            budget_s = rollout_deadline_s(self.args, run_config_of(self.args), evaluation=True, eval_prompts=prompts)
            output, _ = self.steps.guarded(lambda: self.guard.run(
                "eval", rollout_id, lambda: call_rollout_fn(fn, self.args, rollout_id, self.data_source, evaluation=True),
                budget_s=budget_s, weights_version=weights_version))
            log_path = self.args.custom_eval_rollout_log_function_path
            if log_path and self.steps.run(f"{label} --custom-eval-rollout-log-function-path {log_path}",
                                           _call_eval_log, log_path, rollout_id, self.args, output):
                return {}
            return dict(output.metrics or {})

    def _eval_prompts(self) -> int:
        if not hasattr(self, "_eval_prompt_count"):  # rows of every eval file, counted once
            self._eval_prompt_count = sum(sum(1 for _ in read_rows(spec)) for spec in eval_prompt_specs(self.args).values())
        return self._eval_prompt_count

    # ----- engine fault tolerance (the driver's side: slime/ray/driver/rollout_handle.py, rollout_wait.py) -----
    def rollout_status(self) -> dict[str, Any]:
        """Polled by the driver while a rollout or eval runs (this actor is threaded): the time left of
        the guarded generation, else of the step around it."""
        left = self.guard.left_s()
        return {"left_s": self.steps.left_s() if left is None else left, "needs_weights": self.fleet.needing_weights()}

    def engines_caught_up(self, urls: list[str], weights_version: str | None) -> None:
        self.fleet.caught_up(urls, weights_version)

    def engines_for_sync(self) -> list[str]:
        """The engines a weight sync must reach: restarts still running are waited for first."""
        self.fleet.check_processes()
        self.fleet.wait_restarts(ENGINE_STARTUP_S)
        if self.fleet.fatal is not None:
            raise self.fleet.fatal
        return self.fleet.urls()

    def hold_generation(self, timeout_s: float = ENGINE_CONTROL_CALL_S) -> dict[str, float]:
        """Before a weight push while generation may go on (train_async.py): no new request starts, the
        engines abort what they run, and this returns once every request of this process came back."""
        generation_gate.hold()
        deadline = time.monotonic() + timeout_s
        held = len(_generating())
        quiet = 0  # two looks in a row without a request: one that passed the gate just before it closed is seen
        while quiet < 2:
            if time.monotonic() > deadline:
                raise RolloutTimeoutError(f"{len(_generating())} /generate request(s) still running {timeout_s:.0f}s "
                                          "after the engines were told to abort them for a weight push")
            if _generating():
                quiet = 0
                self._each_engine(lambda c: c.abort_all())
            else:
                quiet += 1
            time.sleep(HOLD_POLL_S)
        return {"weight_sync/held_requests": float(held)}

    def release_generation(self) -> None:
        generation_gate.release()

    def offload(self) -> dict[str, float]:
        """Colocate: engines give all their memory (weights, KV cache, CUDA graphs) to the trainer.
        Returns each engine's device memory before and after the release ({}: all was released already)."""
        tags = [tag for tag in MEMORY_TAGS if tag not in self.released]
        if not tags:
            return {}
        before = self._each_engine(lambda c: c.server_info())
        self._each_engine(lambda c: c.release_memory_occupation(tags))
        self.released.update(tags)
        after = self._each_engine(lambda c: c.server_info())
        return engine_memory_metrics(before, after)

    def onload(self, tags: tuple[str, ...] | None) -> None:
        """Resume the given memory tags (None: every tag still released); a tag the engines hold is left."""
        resume = [tag for tag in (tags or MEMORY_TAGS) if tag in self.released]
        if resume:
            self._each_engine(lambda c: c.resume_memory_occupation(resume))
            self.released.difference_update(resume)

    def _each_engine(self, call) -> list:
        urls = self.fleet.urls()
        with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
            return list(pool.map(lambda url: call(SGLangHTTPClient(url)), urls))

    def shutdown(self) -> None:
        self.guard.monitor.close()
        if self.router is not None:
            self.router.stop()
        self._stop_engines()

    def _stop_engines(self, timeout_s: float = ROLLOUT_MANAGER_SHUTDOWN_S) -> None:
        actors = [actor for parts in self._engine_actors for actor in parts]
        stops = [actor.stop.remote() for actor in actors]
        ray.wait(stops, num_returns=len(stops), timeout=timeout_s)
        for actor in actors:
            ray.kill(actor, no_restart=True)


def engine_log_dir(ledger_dir: str) -> str:
    """Where the engines and the router write their logs (kept in place by a restart: healing.KEPT_IN_LEDGER)."""
    return os.path.join(ledger_dir, "engine-logs")


def _generating() -> list:
    return [r for r in outstanding_requests() if r.url.endswith("/generate")]


def _call_rollout_log(path: str, rollout_id: int, args, samples: list[Sample], metrics: dict, rollout_time: float) -> bool:
    """--custom-rollout-log-function-path: True means it replaced the default rollout logging."""
    return bool(load_function(path)(rollout_id, args, samples, metrics, rollout_time))


def _call_eval_log(path: str, rollout_id: int, args, output) -> bool:
    """--custom-eval-rollout-log-function-path: True means it replaced the default eval logging."""
    return bool(load_function(path)(rollout_id, args, output.data, output.metrics))


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


def load_debug_rollout(path: str) -> dict[str, Any]:
    """A --save-debug-rollout-data file: plain data (Sample.to_dict), so it loads without running any
    pickled code (torch's weights_only loader)."""
    import pickle

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"--load-debug-rollout-data {path}: holds objects other than plain data (dicts, lists, "
                         f"numbers, strings, tensors), which are not unpickled since that could run code; store "
                         f"plug-in fields in Sample.metadata as plain data ({exc})") from None


def engine_nodes_of(actors: Sequence[Sequence], *, timeout_s: float) -> list[list[EngineNodes | None]]:
    """Per engine (its actors, one per node, node rank 0 first), what each node's process is launched with: None
    within one node; over several nodes --nnodes, its --node-rank and the address node rank 0's actor reserved."""
    addresses = {rank: parts[0].dist_init_addr.remote() for rank, parts in enumerate(actors) if len(parts) > 1}
    found = dict(zip(addresses, ray.get(list(addresses.values()), timeout=timeout_s))) if addresses else {}
    return [[EngineNodes(nnodes=len(parts), node_rank=k, dist_init_addr=found[rank]) for k in range(len(parts))]
            if len(parts) > 1 else [None] for rank, parts in enumerate(actors)]


def _describe(slots: Iterable[EngineSlot]) -> str:
    return "; ".join(f"engine {s.rank}{f' node rank {s.node_rank}' if s.node_rank or s.followers else ''} on node "
                     f"{s.node_ip} ({s.node_id[:8]}), gpus {list(s.gpu_ids)}" for s in slots)


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


def check_train_data(data: Any, origin: str) -> None:
    """A custom conversion must return the trainer's keys, one entry per sample each."""
    if not isinstance(data, dict):
        raise TypeError(f"{origin} returned {type(data).__name__}, expected a dict of per-sample lists")
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise KeyError(f"{origin} returned no {missing} (needs {list(REQUIRED_KEYS)})")
    lengths = {k: len(data[k]) for k in REQUIRED_KEYS}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{origin} returned lists of different lengths: {lengths}")
