"""What the run learns once it starts, typed and frozen: the ``RunState``.

The flags are fixed by ``parse_args`` and the run config is derived from them once (run_config.py). Some facts
only exist later: where the placement put the ranks, the ledger dir the first session made, the router's address,
the rollout the run resumes at, how many restarts it has made. They live here, one value per fact, and change
only by replacement, never by writing into the flags.

The driver holds the run's current state on its own namespace (``args.run_state``: a restart's session starts from
a fresh namespace, healing.resume_args) and replaces it with ``advance``. The Ray actors (trainer ranks, critic
ranks, rollout manager, engines) receive the state their driver had when it started them as an explicit argument,
and their ``args`` without it (``actor_args``): an actor keeps its own copy and replaces it itself (a rank's node
address, the router's address).

``publish`` is the one place that writes run-state facts into ``args``: upstream's plug-in surface (custom rollout,
reward, data-source and loss functions, and train.py-shaped scripts) receives ``args`` and reads
``args.start_rollout_id``, ``args.num_rollout`` and ``args.sglang_router_ip`` / ``args.sglang_router_port``
(upstream sets them there), so those four are published under their upstream names, by the driver's ``advance``
and by an actor that learns one of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

PUBLISHED = {"start_rollout_id": "start_rollout_id", "num_rollout": "num_rollout",
             "router_ip": "sglang_router_ip", "router_port": "sglang_router_port"}
"""Run-state field -> the ``args`` name upstream's plug-ins read it by."""


@dataclass(frozen=True, kw_only=True)
class RunState:
    """The run's facts after parsing (replaced by ``advance``, never mutated)."""

    ledger_dir: str | None
    """The ranks' ledger dir: --ledger-dir, or a temporary one the first session makes."""
    ledger_dir_is_temp: bool = False
    """The first session made ``ledger_dir`` (removed when the run ends)."""
    spans_nodes: bool = False
    """The placement holds more than one node: servers listen on the node's address instead of loopback."""
    colocated_node_hosts: tuple[str, ...] = ()
    """Colocated over several nodes: each node's address, by node index (the weight push's node routes)."""
    node_host: str | None = None
    """A trainer rank's own node address (set in its process: the colocated push feeds the engines there)."""
    start_rollout_id: int | None
    """The first rollout of this session: --start-rollout-id, or --load's position (None until it is read)."""
    start_rollout_id_given: bool
    """--start-rollout-id was given (it wins over --load's position; a restart reads the checkpoint's)."""
    num_rollout: int | None
    """--num-rollout, or the rollouts --num-epoch takes once the data is read."""
    router_ip: str | None
    """The address the rollout functions reach the router at (--sglang-router-ip, or where it was started)."""
    router_port: int | None
    restart_count: int = 0
    """Restarts made so far (--max-restarts; 0 on the first attempt)."""
    restart_checkpoint: int | None = None
    """The checkpoint the latest restart went back to."""
    restart_detected_at: float | None = None
    """time.monotonic() when the failure the latest restart heals was detected."""


def initial_run_state(args: Any) -> RunState:
    """The state before anything has started: the facts the flags give."""
    return RunState(ledger_dir=args.ledger_dir, start_rollout_id=args.start_rollout_id,
                    start_rollout_id_given=args.start_rollout_id is not None, num_rollout=args.num_rollout,
                    router_ip=args.sglang_router_ip, router_port=args.sglang_router_port)


def run_state_of(args: Any) -> RunState:
    """The run state the driver's ``args`` carry, or (arguments built without parse_args) the initial one of its
    flags."""
    state = vars(args).get("run_state")
    return state if state is not None else initial_run_state(args)


def advance(args: Any, **facts: Any) -> RunState:
    """The driver's run state with ``facts`` replaced, held on its namespace and published (``publish``)."""
    state = dataclasses.replace(run_state_of(args), **facts)
    args.run_state = state
    publish(args, state)
    return state


def publish(args: Any, state: RunState) -> None:
    """Write the facts upstream's plug-ins read into ``args`` under their upstream names."""
    for field, name in PUBLISHED.items():
        setattr(args, name, getattr(state, field))


def actor_args(args: Any) -> Any:
    """``args`` as the driver hands them to a Ray actor: the flags, the run config and the published names, without
    the driver's run state, which the actor receives as an argument of its own."""
    return type(args)(**{name: value for name, value in vars(args).items() if name != "run_state"})
