"""A Ray cluster of several nodes on one machine, for tests: Ray's own `cluster_utils.Cluster`.

It runs in a child process with a private RAY_TMPDIR, so the address file it writes (what
`ray start --head` writes: `ray.init()` and `train.py` join that cluster) never reaches the
machine's default /tmp/ray, where other runs would find it. Clients get that RAY_TMPDIR through
`RayTestCluster.env`.

    python tests/ray_cluster.py '[{"num_cpus": 1}, {"num_cpus": 1, "node_ip_address": "127.0.0.2"}]'

prints `ADDRESS <gcs address>` once every node is up, then holds the cluster until stdin closes.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from slime.patches.ray import ENV_SWITCH

STARTUP_TIMEOUT_S = 180.0
# Every node on loopback unless a test names another loopback address (127.0.0.2): no traffic leaves the machine.
NODE_DEFAULTS = {"object_store_memory": 100 * 1024**2, "node_ip_address": "127.0.0.1"}


def second_loopback_address() -> str | None:
    """127.0.0.2 when this machine can bind it (Linux routes all of 127/8 to loopback), else None."""
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.2", 0))
        return "127.0.0.2"
    except OSError:
        return None


@dataclass
class RayTestCluster:
    nodes: list[dict]
    address: str = ""
    temp_dir: str = ""
    _process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def env(self) -> dict[str, str]:
        """Env for a client that must find this cluster the way `ray start` users' drivers do."""
        return {"RAY_TMPDIR": self.temp_dir, ENV_SWITCH: "0"}

    def __enter__(self) -> "RayTestCluster":
        # Short on purpose: Ray's socket paths live under it and Unix sockets allow ~107 characters.
        self.temp_dir = tempfile.mkdtemp(prefix="rtc", dir="/tmp")
        env = {**os.environ, **self.env}
        env.pop("RAY_ADDRESS", None)
        with open(self.log_path, "w") as log:  # a file, not a pipe nobody reads once the cluster is up
            self._process = subprocess.Popen([sys.executable, __file__, json.dumps(self.nodes)], env=env,
                                             stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            self.address = self._read_address()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @property
    def log_path(self) -> Path:
        return Path(self.temp_dir) / "cluster.log"

    def _read_address(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline and self._process.poll() is None:
            for line in self.log_path.read_text().splitlines():
                if line.startswith("ADDRESS "):
                    return line.split()[1]
            time.sleep(0.2)
        raise RuntimeError("the test Ray cluster did not start:\n" + self.log_path.read_text()[-4000:])

    def __exit__(self, *exc) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.stdin.close()  # the child shuts the cluster down and exits
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


# One single-node cluster per test process (each pytest-xdist worker has its own), sized for the largest run:
# every train.py run the tests start joins it (tests/train_runs.py: train_env) instead of starting Ray's own
# processes again. Runs that must own their cluster (a run-kill fault takes the run's whole session down,
# the two-node runs) do not use it.
SHARED_NODE = {"num_cpus": 32, "object_store_memory": 2 * 1024**3}
_shared: RayTestCluster | None = None


def shared_cluster_address() -> str:
    """The address of this test process's shared cluster, started on first use and stopped at exit."""
    global _shared
    if _shared is None:
        _shared = RayTestCluster([SHARED_NODE]).__enter__()
        atexit.register(_shared.__exit__, None, None, None)
    return _shared.address


def _serve(nodes: list[dict]) -> None:
    os.environ[ENV_SWITCH] = "0"  # before Ray is imported: loopback addresses stay loopback (slime/patches/ray.py)
    from ray.cluster_utils import Cluster

    head, *others = nodes
    cluster = Cluster(initialize_head=True, head_node_args={**NODE_DEFAULTS, "include_dashboard": False, **head})
    try:
        for node in others:
            cluster.add_node(**{**NODE_DEFAULTS, **node})
        cluster.wait_for_nodes()
        print("ADDRESS", cluster.address, flush=True)
        sys.stdin.read()  # until the parent closes it (or dies)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
