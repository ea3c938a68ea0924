"""The Ray cluster around a job: which one to join, the env every actor gets, actors Ray cancels before they run.

Users start a cluster with `ray start --head` / `ray start --address` and run `python train.py` on
the head or `ray job submit -- python train.py` (which sets RAY_ADDRESS); without one, train.py
starts a private cluster on this machine (slime/ray/driver/placement.py:init_ray), on the loopback address.
Where each process's servers listen is the node's own business (slime/ray/common/node.py).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Callable, TypeVar

import ray

from slime.ray.common.node import HOST_IP_ENV, PlacementError
from slime.utils.deadlines import RAY_ADDRESS_PROBE_S

logger = logging.getLogger(__name__)
T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[3]
NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
# Env the ranks and engines must see wherever they run (names, or prefixes ending in "_").
FORWARDED_ENV = ("SLIME_", "NCCL_", "GLOO_", "TORCH_", "HF_", "TRANSFORMERS_OFFLINE", "OMP_NUM_THREADS",
                 "CUDA_DEVICE_MAX_CONNECTIONS", "PYTHONPATH")
NODE_LOCAL_ENV = (HOST_IP_ENV,)  # each node has its own value: never copied from the driver


def cluster_address(env: dict[str, str] | None = None) -> str | None:
    """The Ray cluster to join, or None to start a private one.

    RAY_ADDRESS (set by `ray job submit`, or by hand; "local" forces a private cluster), else the
    address `ray start --head` on this machine left in <ray temp dir>/ray_current_cluster.
    """
    env = os.environ if env is None else env
    address = env.get("RAY_ADDRESS", "").strip()
    if address == "local":
        return None
    if address and address != "auto":
        return address
    temp_root = env.get("RAY_TMPDIR") or env.get("TMPDIR") or "/tmp"
    current = Path(temp_root) / "ray" / "ray_current_cluster"
    if current.is_file() and current.read_text().strip():
        return current.read_text().strip()
    if address == "auto":
        raise PlacementError("RAY_ADDRESS=auto but no cluster was started here with `ray start`")
    return None


def require_reachable(address: str, timeout_s: float = RAY_ADDRESS_PROBE_S) -> None:
    """Ray retries an unreachable address for minutes; a dead cluster's stale address fails here at once."""
    if "://" in address:  # ray://... (Ray Client) is checked by Ray itself
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise PlacementError(
            f"no Ray cluster answers at {address} ({exc}). It comes from RAY_ADDRESS or from the address file "
            "`ray start` leaves: start the cluster (`ray start --head`), clear a stale address with `ray stop`, "
            "or set RAY_ADDRESS=local for a private single-machine cluster") from None


def worker_env(use_gpu: bool) -> dict[str, str]:
    """Env vars for every trainer rank, engine and the rollout manager, on any node."""
    env = {k: v for k, v in os.environ.items()
           if k.startswith(FORWARDED_ENV) and k not in NODE_LOCAL_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if use_gpu:
        env[NOSET_VISIBLE_DEVICES] = "1"
    return env


def cancelled_before_start(err: BaseException) -> bool:
    """Whether Ray reports an actor as cancelled before its constructor ran (nothing of it ever ran).
    Ray keeps only the message of the death's cause on the error, so the message is what is read."""
    return isinstance(err, ray.exceptions.ActorDiedError) and "it was cancelled before it started running" in str(err)


# Ray's cancellations of an actor that never ran: the pause before each new start (one more start than pauses).
# Seen three times in a row on a loaded 2-core machine, so the pauses reach half a minute in all.
CANCELLED_START_PAUSES_S = (2.0, 5.0, 10.0, 15.0)


def retry_if_cancelled_before_start(start: Callable[[], T], what: str,
                                    pauses_s: tuple[float, ...] = CANCELLED_START_PAUSES_S) -> T:
    """start() again, after a pause, while Ray cancels the actor it made before the actor ran.

    Seen on a cluster whose drivers come and go: Ray's control store cancels a new driver's first
    actor before it runs, as if the driver had dropped it, and a start at once can meet the same fate.
    Nothing of it ran, so starting it again is safe; any other death (its constructor raised, its process
    died), or a cancellation of the last start, is the run's error."""
    for pause_s in pauses_s:
        try:
            return start()
        except ray.exceptions.ActorDiedError as err:
            if not cancelled_before_start(err):
                raise
            logger.warning("Ray cancelled %s before it started; starting it again in %.0fs", what, pause_s)
        time.sleep(pause_s)
    return start()

