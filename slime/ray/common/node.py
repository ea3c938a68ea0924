"""The node a process of the run is on, as that process sees it: the address other nodes reach it at, where the
servers it starts listen, and which CUDA device a GPU id from Ray is.

A run on one node keeps every server (engines, router, rendezvous) on loopback; only a run that spans nodes listens
on node addresses (`serving_host`).
"""
from __future__ import annotations

import os

import ray

LOOPBACK = "127.0.0.1"
HOST_IP_ENV = "SLIME_HOST_IP"  # upstream's per-node override of the node's address


class PlacementError(RuntimeError):
    """The cluster cannot hold the requested layout, or the layout cannot be placed as asked."""


def node_address() -> str:
    """This node's address as other nodes reach it: SLIME_HOST_IP if set here, else Ray's node IP."""
    return os.environ.get(HOST_IP_ENV) or ray.util.get_node_ip_address()


def is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "[::]")


def advertised_host(bind_host: str | None) -> str:
    """Where peers reach a server bound to `bind_host` on this node (None: the node's address)."""
    if not bind_host or is_wildcard(bind_host):
        return node_address()
    return bind_host


def serving_host(spans_nodes: bool) -> str:
    """Where a server this run starts listens by default: loopback unless peers on other nodes must reach it."""
    return node_address() if spans_nodes else LOOPBACK


def visible_device_index(gpu_id: int | str, visible: str | None = None) -> int:
    """The CUDA device index of Ray's GPU id in a process that sees every GPU of the node.

    Ray reports ids as listed in the raylet's CUDA_VISIBLE_DEVICES when one was set, which the
    process inherits (with NOSET Ray does not change it); else as plain indices.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if not visible:
        return int(gpu_id)
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if str(gpu_id) not in listed:
        raise PlacementError(f"GPU id {gpu_id} from Ray is not in CUDA_VISIBLE_DEVICES={visible}")
    return listed.index(str(gpu_id))
