"""Runtime patch of Ray (2.4x-2.6x): a private single-machine cluster stays on loopback.

Ray rewrites every loopback address it is given ("127.0.0.1", "localhost", "::1": the node address
of `ray.init(_node_ip_address=...)` and the address a driver joins) into the machine's network
address, so that other machines could reach the node. A cluster this project starts for one machine
has no other machines: its GCS, raylet, object manager and workers would then talk over the
machine's network address for nothing. Ray keeps loopback only where it takes multi-node clusters
to be unsupported (its `ENABLE_RAY_CLUSTER` switch, the `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` env var
read at import); clearing that switch in the driver before `ray.init` makes Ray's node address
loopback for the private cluster, its workers included (they take the raylet's address). Joining a
cluster that `ray start` made is not touched. Tests whose multi-node Ray clusters live on this
machine's loopback addresses set the env var for every process instead (tests/conftest.py).
"""
from __future__ import annotations

ENV_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_cluster_on_loopback() -> None:
    """Call in the driver before `ray.init(address="local")` (a cluster of this machine alone)."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
