"""One rollout engine's Ray actor: it runs on the engine's first bundle and starts the engine there.

The engine process (SGLang, or the embedded engine) is a child of this actor, so it runs on the
bundle's node with the bundle's GPUs and listens on loopback when the whole run is on one node, on
that node's address (reachable by URL from every other node) when the run spans nodes. Generation and weight updates go to that URL over HTTP; the actor only starts,
describes, signals and stops the process; `RemoteEngine` is the rollout manager's view of it (what
the engine fleet needs: exit code, signals to the process tree, restart on a new port).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray

from slime.backends.sglang_utils.launcher import EngineHandle, launch_engine
from slime.ray.driver.cluster import advertised_host, node_address, serving_host
from slime.ray.engines.recovery import LocalEngine
from slime.ray.driver.placement import EngineSlot, visible_device_index
from slime.utils.deadlines import ENGINE_ACTOR_CALL_S
from slime.utils.security import use_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EngineEndpoint:
    """A started engine: where it runs and how to reach it."""

    rank: int
    url: str
    node_id: str
    node_ip: str
    bind_host: str
    gpu_ids: tuple[str, ...]
    """Ray's ids of the engine's GPUs (empty on CPU)."""
    device_indices: tuple[int, ...]
    """The same GPUs as CUDA device indices of a process that sees the whole node."""


class EngineRayActor:
    def __init__(self, args: Any, slot: EngineSlot, backend: str, log_dir: str):
        use_key(args.api_key)  # the engine inherits it; health checks send it
        self.args = args
        self.slot = slot
        self.backend = backend
        self.log_dir = log_dir
        self.engine: EngineHandle | None = None
        self.endpoint: EngineEndpoint | None = None

    def devices(self) -> tuple[int, ...]:
        """The engine's GPUs as CUDA device indices of this process, which sees the whole node."""
        return tuple(visible_device_index(g) for g in self.slot.gpu_ids)

    def where(self) -> dict:
        """Where this actor runs and what Ray gave it (a share of the engine's first bundle)."""
        return {"rank": self.slot.rank, "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": node_address(), "ray_gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "device_indices": list(self.devices())}

    def start(self, startup_timeout_s: float) -> EngineEndpoint:
        """Start the engine on this node and return once it answers /health."""
        bind = self.args.engine_bind_host or serving_host(self.args.spans_nodes)
        devices = self.devices()
        self.engine = launch_engine(  # port 0: one no other process can take first (launch_engine says how)
            self.backend, self.args, self.slot.rank, 0, self.args.hf_checkpoint,
            host=bind, gpu_ids=devices, startup_timeout_s=startup_timeout_s, log_dir=self.log_dir)
        self.endpoint = EngineEndpoint(
            rank=self.slot.rank, url=f"http://{_url_host(advertised_host(bind))}:{self.engine.port}",
            node_id=ray.get_runtime_context().get_node_id(), node_ip=node_address(), bind_host=bind,
            gpu_ids=self.slot.gpu_ids, device_indices=devices)
        logger.info("engine %d on node %s at %s (gpus %s)", self.slot.rank, self.endpoint.node_ip,
                    self.endpoint.url, list(self.slot.gpu_ids))
        return self.endpoint

    def restart(self, startup_timeout_s: float) -> EngineEndpoint:
        """Stop whatever is left of the engine and start a new one on a new port (fault tolerance)."""
        self.stop()
        return self.start(startup_timeout_s)

    def exit_code(self) -> int | None:
        return LocalEngine(self.engine).exit_code() if self.engine is not None else None

    def signal(self, sig: int) -> None:
        if self.engine is not None:
            LocalEngine(self.engine).signal(sig)

    def process_state(self) -> str:
        return LocalEngine(self.engine).process_state() if self.engine is not None else "not started"

    def stop(self) -> None:
        if self.engine is not None:
            LocalEngine(self.engine).stop()


class RemoteEngine:
    """The rollout manager's handle on an engine its `EngineRayActor` started (slime.ray.engines.recovery's
    EngineProcess). An engine actor that is gone (its node died) reads as an exited engine."""

    def __init__(self, actor: Any, endpoint: EngineEndpoint, control_timeout_s: float = ENGINE_ACTOR_CALL_S) -> None:
        self.actor = actor
        self.endpoint = endpoint
        self.url = endpoint.url
        self._timeout_s = control_timeout_s

    def _call(self, method: str, *args, lost: Any = None, silent: Any = None) -> Any:
        """`lost` when the actor is gone; `silent` when it did not answer in time (it may only be slow:
        the health probes, not this, decide that an engine that still runs is unresponsive)."""
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=self._timeout_s)
        except ray.exceptions.RayActorError:
            return lost
        except ray.exceptions.GetTimeoutError:
            return silent

    def exit_code(self) -> int | None:
        return self._call("exit_code", lost=-1)

    def signal(self, sig: int) -> None:
        self._call("signal", int(sig))

    def process_state(self) -> str:
        return self._call("process_state", lost="engine actor lost", silent="engine actor not answering")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
