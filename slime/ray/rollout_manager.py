"""The rollout side: engines, the router, the data source and the rollout function.

`RolloutManager` is one Ray actor. It starts one engine per `--rollout-num-gpus-per-engine`
devices (real SGLang servers on GPUs, the embedded engine elsewhere: both answer the same
HTTP API), puts a router in front, and turns each rollout into the trainer's batch. The
driver talks to it through `RolloutManagerHandle`, whose calls all carry a deadline.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
import torch

from slime.backends.sglang_utils.launcher import EngineHandle, launch_engine, pick_rollout_backend
from slime.rollout.advantages import TRAIN_DATA_KEYS, flatten_groups, samples_to_train_data
from slime.rollout.base_types import call_rollout_fn
from slime.rollout.metrics import compute_rollout_metrics
from slime.router.router import launch_router
from slime.utils.misc import load_function
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

# Engine-control calls (release/resume memory, flush) are quick; generation is bounded by the
# per-request HTTP timeout of the rollout function, not here.
CONTROL_TIMEOUT_S = 300.0
STARTUP_TIMEOUT_S = 900.0


def num_engines(args) -> int:
    if args.debug_train_only:
        return 0
    return max(1, args.rollout_num_gpus // args.rollout_num_gpus_per_engine)


class RolloutManager:
    def __init__(self, args):
        self.args = args
        self.data_source = load_function(args.data_source_path)(args)  # --data-source-path: cls(args)
        if args.start_rollout_id > 0:  # resume after the rollout whose data position was saved
            self.data_source.load(args.start_rollout_id - 1)
        self.backend = pick_rollout_backend(args)
        self.log_dir = os.path.join(args.ledger_dir or "/tmp", "engine-logs")
        self.engines: list[EngineHandle] = self._launch_engines()
        self.router = (_retry_port_clash(lambda: launch_router(args, [e.url for e in self.engines],
                                                               log_dir=self.log_dir))
                       if self.engines else None)
        if self.router is not None:
            args.sglang_router_ip, args.sglang_router_port = self.router.host, self.router.port
        self._rollout_fn = load_function(args.rollout_function_path)

    def _launch_engines(self) -> list[EngineHandle]:
        count = num_engines(self.args)
        if count == 0:
            return []
        from slime.ray.actor_group import free_port

        model = self.args.hf_checkpoint
        log_dir = self.log_dir
        logger.info("starting %d %s engine(s) for %s", count, self.backend, model)

        def launch(rank: int) -> EngineHandle:
            return _retry_port_clash(lambda: launch_engine(
                self.backend, self.args, rank, free_port(), model,
                startup_timeout_s=STARTUP_TIMEOUT_S, log_dir=log_dir))

        with ThreadPoolExecutor(max_workers=count) as pool:
            return list(pool.map(launch, range(count)))

    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def num_prompts(self) -> int:
        return len(self.data_source)

    def generate(self, rollout_id: int) -> tuple[list[ray.ObjectRef], dict[str, Any]]:
        """One rollout as the trainer's batch, and its metrics ({} when a custom log function took over)."""
        start = time.monotonic()
        samples, metrics = self._samples(rollout_id)
        rollout_time = time.monotonic() - start
        if self.args.save_debug_rollout_data:
            path = self.args.save_debug_rollout_data.format(rollout_id=rollout_id)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.save({"rollout_id": rollout_id, "samples": [s.to_dict() for s in samples]}, path)
        data = self._train_data(samples)
        if self.args.save:
            self.data_source.save(rollout_id)
        if self._custom_log(rollout_id, samples, metrics, rollout_time):
            return [ray.put(data)], {}
        metrics = {**compute_rollout_metrics(self.args, samples), **(metrics or {})}
        return [ray.put(data)], {f"rollout/{k}" if "/" not in k else k: v for k, v in metrics.items()}

    def _samples(self, rollout_id: int) -> tuple[list[Sample], dict[str, Any]]:
        if self.args.load_debug_rollout_data:
            path = self.args.load_debug_rollout_data.format(rollout_id=rollout_id)
            saved = torch.load(path, weights_only=False)
            return [Sample.from_dict(d) for d in saved["samples"]], {}
        if hasattr(self.data_source, "rollout_id"):  # what --buffer-filter-path receives
            self.data_source.rollout_id = rollout_id
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

    def _custom_log(self, rollout_id: int, samples: list[Sample], metrics: dict, rollout_time: float) -> bool:
        """--custom-rollout-log-function-path: True means it replaced the default rollout logging."""
        path = self.args.custom_rollout_log_function_path
        return bool(path) and bool(load_function(path)(rollout_id, self.args, samples, metrics, rollout_time))

    def evaluate(self, rollout_id: int) -> dict[str, Any]:
        """Eval metrics ({} when --custom-eval-rollout-log-function-path took over the logging)."""
        fn = load_function(self.args.eval_function_path or self.args.rollout_function_path)
        output = call_rollout_fn(fn, self.args, rollout_id, self.data_source, evaluation=True)
        path = self.args.custom_eval_rollout_log_function_path
        if path and load_function(path)(rollout_id, self.args, output.data, output.metrics):
            return {}
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
            return list(pool.map(lambda e: call(e.client()), self.engines))

    def shutdown(self) -> None:
        if self.router is not None:
            self.router.stop()
        for engine in self.engines:
            engine.stop()


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
    missing = [k for k in TRAIN_DATA_KEYS if k not in data]
    if missing:
        raise KeyError(f"{origin} returned no {missing} (needs {list(TRAIN_DATA_KEYS)})")
    lengths = {k: len(data[k]) for k in TRAIN_DATA_KEYS}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{origin} returned lists of different lengths: {lengths}")


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
        self._get(self._actor.engine_urls.remote(), "start engines", STARTUP_TIMEOUT_S + 60)

    def engine_urls(self) -> list[str]:
        return self._get(self._actor.engine_urls.remote(), "engine_urls", CONTROL_TIMEOUT_S)

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


def create_rollout_manager(args, placement) -> RolloutManagerHandle:
    # The manager only drives HTTP and subprocesses; it reserves no device of its own.
    actor = ray.remote(num_cpus=0)(RolloutManager).remote(args)
    handle = RolloutManagerHandle(actor)
    handle.wait_ready()
    return handle
