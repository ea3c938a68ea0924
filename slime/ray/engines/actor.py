"""One rollout engine's Ray actor: it runs on the engine's first bundle and starts the engine there. An engine over
several nodes has one such actor per node (each starts its node's SGLang process: --nnodes, --node-rank); the
rollout manager sees them as one engine (`SpanningEngine`), addressed at node rank 0's URL.

The engine process (SGLang, or the embedded engine) is a child of this actor, so it runs on the
bundle's node with the bundle's GPUs and listens on loopback when the whole run is on one node, on
that node's address (reachable by URL from every other node) when the run spans nodes. Generation and weight updates go to that URL over HTTP; the actor only starts,
describes, signals and stops the process; `RemoteEngine` is the rollout manager's view of it (what
the engine fleet needs: exit code, signals to the process tree, restart on a new port).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import ray

from slime.config.run_state import RunState
from slime.backends.sglang_utils.launcher import EngineHandle, EngineNodes, launch_engine
from slime.ray.common.engine_slot import EngineSlot
from slime.ray.common.node import advertised_host, node_address, serving_host, visible_device_index
from slime.ray.engines.recovery import LocalEngine
from slime.utils.deadlines import ENGINE_ACTOR_CALL_S
from slime.utils.ports import find_free_port
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
    node_rank: int = 0
    """This process's node within an engine over several nodes (node rank 0's URL is the engine's)."""


class EngineRayActor:
    def __init__(self, args: Any, run_state: RunState, slot: EngineSlot, backend: str, log_dir: str):
        """`run_state`: the driver's when it started this actor (whether the run spans nodes)."""
        use_key(args.api_key)  # the engine inherits it; health checks send it
        self.args = args
        self.run_state = run_state
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

    def bind_host(self) -> str:
        return self.args.engine_bind_host or serving_host(self.run_state.spans_nodes)

    def dist_init_addr(self) -> str:
        """host:port on this node (node rank 0 of an engine over several nodes) where its processes meet: a port
        free now, which SGLang's node rank 0 binds when it starts."""
        bind = self.bind_host()
        return f"{_url_host(advertised_host(bind))}:{find_free_port(bind)}"

    def start(self, startup_timeout_s: float, nodes: EngineNodes | None = None) -> EngineEndpoint:
        """Start the engine (`nodes`: this node's process of an engine over several) on this node and return once
        it answers /health."""
        bind = self.bind_host()
        devices = self.devices()
        self.engine = launch_engine(  # port 0: one no other process can take first (launch_engine says how)
            self.backend, self.args, self.slot.rank, 0, self.args.hf_checkpoint,
            host=bind, gpu_ids=devices, startup_timeout_s=startup_timeout_s, log_dir=self.log_dir, nodes=nodes)
        self.endpoint = EngineEndpoint(
            rank=self.slot.rank, url=f"http://{_url_host(advertised_host(bind))}:{self.engine.port}",
            node_id=ray.get_runtime_context().get_node_id(), node_ip=node_address(), bind_host=bind,
            gpu_ids=self.slot.gpu_ids, device_indices=devices, node_rank=self.slot.node_rank)
        logger.info("engine %d%s on node %s at %s (gpus %s)", self.slot.rank,
                    f" node rank {nodes.node_rank} of {nodes.nnodes}" if nodes is not None else "",
                    self.endpoint.node_ip, self.endpoint.url, list(self.slot.gpu_ids))
        return self.endpoint

    def serving_endpoint(self) -> EngineEndpoint:
        """The running engine's endpoint (a new rollout manager adopts it); an error when it is not running."""
        if self.engine is None or self.endpoint is None or LocalEngine(self.engine).exit_code() is not None:
            raise RuntimeError(f"engine {self.slot.rank} is not running ({self.process_state()})")
        return self.endpoint

    def restart(self, startup_timeout_s: float, nodes: EngineNodes | None = None) -> EngineEndpoint:
        """Stop whatever is left of the engine and start a new one on a new port (fault tolerance)."""
        self.stop()
        return self.start(startup_timeout_s, nodes)

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


class SpanningEngine:
    """An engine over several nodes as one engine (recovery.EngineProcess): its URL is node rank 0's, which serves
    the whole HTTP API (generation, weight updates, memory); it has exited as soon as any node's process has (the
    engine's tensor-parallel ranks are spread over all of them), and a signal goes to every node's process."""

    def __init__(self, parts: Sequence[Any]) -> None:
        if len(parts) < 2:
            raise ValueError("an engine over several nodes has a process on each: give every node's handle")
        self.parts = tuple(parts)
        self.url = parts[0].url
        self.endpoint = getattr(parts[0], "endpoint", None)

    def exit_code(self) -> int | None:
        return next((code for code in (part.exit_code() for part in self.parts) if code is not None), None)

    def signal(self, sig: int) -> None:
        for part in self.parts:
            part.signal(sig)

    def process_state(self) -> str:
        states = [part.process_state() for part in self.parts]
        if all(state == "alive" for state in states):
            return "alive"
        return "; ".join(f"node rank {rank}: {state}" for rank, state in enumerate(states))


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
