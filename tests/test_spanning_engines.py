"""Engines larger than a node (SGLang's multi-node launch): the checks before Ray starts, what each node's process
is launched with, and the rollout side's view of one engine over several processes (health, failure, restart).

Placement on a simulated cluster: tests/test_placement.py and tests/test_upstream_launchers.py; the launch argv
parsed back by SGLang's own parser: tests/test_sglang_contract.py. An end-to-end run needs several GPU machines
and has not run (docs/cluster.md).
"""
from __future__ import annotations

import signal

import pytest

from arg_testing import no_real_sglang, parse_error, parse_quiet  # noqa: F401 (fixture)
from slime.ray.engines.actor import SpanningEngine
from slime.ray.engines.recovery import EngineFleet

BASE = ["--rollout-batch-size", "8", "--num-rollout", "1", "--actor-num-gpus-per-node", "8",
        "--train-backend-device", "cpu", "--num-gpus-per-node", "8"]


# ----------------------------------------------------------------------------- before Ray
def test_an_sglang_engine_over_whole_nodes_parses():
    args = parse_quiet(BASE + ["--rollout-num-gpus", "32", "--rollout-num-gpus-per-engine", "16",
                               "--rollout-backend", "sglang"])
    assert args.run_config.roles.engines == 2 and args.run_config.roles.gpus_per_engine == 16


@pytest.mark.parametrize("extra, says", [
    (["--rollout-num-gpus-per-engine", "12", "--rollout-backend", "sglang"],
     "splits an engine's tensor-parallel ranks evenly over its nodes (--nnodes); use a multiple of 8"),
    (["--rollout-num-gpus-per-engine", "16", "--rollout-backend", "embedded"],
     "the embedded engine is one process on one machine and cannot span nodes"),
])
def test_an_engine_over_nodes_that_cannot_launch_is_refused(extra, says, capsys):
    err = parse_error(BASE + ["--rollout-num-gpus", "48", *extra], capsys)
    assert says in err, err


def test_a_colocated_engine_over_nodes_is_refused_with_what_it_lacks(capsys):
    err = parse_error(BASE + ["--actor-num-nodes", "2", "--colocate", "--rollout-num-gpus-per-engine", "16",
                              "--rollout-backend", "sglang"], capsys)
    assert "an engine of --rollout-num-gpus-per-engine 16 GPUs spans 2 nodes" in err
    assert "gathered into one request to its node rank 0" in err and "Drop --colocate" in err


# ----------------------------------------------------------------------------- one engine, several processes
class _Part:
    """Stands in for a node's RemoteEngine: an exit code, the signals it got."""

    def __init__(self, url: str) -> None:
        self.url, self.code, self.signals = url, None, []

    def exit_code(self):
        return self.code

    def signal(self, sig: int) -> None:
        self.signals.append(sig)

    def process_state(self) -> str:
        return "alive" if self.code is None else f"exited with code {self.code}"


def test_an_engine_over_nodes_is_one_engine_at_node_rank_0s_url():
    leader, follower = _Part("http://10.0.0.2:30000"), _Part("http://10.0.0.3:30001")
    engine = SpanningEngine([leader, follower])
    assert engine.url == leader.url and engine.exit_code() is None and engine.process_state() == "alive"
    follower.code = 137  # a node's process gone: the engine's tensor-parallel ranks there are gone with it
    assert engine.exit_code() == 137
    assert engine.process_state() == "node rank 0: alive; node rank 1: exited with code 137"
    engine.signal(signal.SIGKILL)
    assert leader.signals == follower.signals == [signal.SIGKILL]


def test_a_follower_that_exits_fails_and_restarts_the_whole_engine():
    parts = [_Part("http://10.0.0.2:30000"), _Part("http://10.0.0.3:30001")]
    relaunched = []

    def relaunch(rank):
        relaunched.append(rank)
        return SpanningEngine([_Part("http://10.0.0.2:30100"), _Part("http://10.0.0.3:30101")])

    fleet = EngineFleet([SpanningEngine(parts)], relaunch=relaunch, router=None, fault_tolerant=True)
    assert fleet.urls() == ["http://10.0.0.2:30000"]  # the weight push and the router address node rank 0
    parts[1].code = 1
    fleet.check_processes()
    fleet.wait_restarts(timeout_s=10)
    assert [p.signals for p in parts] == [[signal.SIGKILL]] * 2  # every node's process tree is killed
    assert relaunched == [0] and "process exited with code 1" in fleet.failures[0].reason
    assert fleet.slots[0].url == "http://10.0.0.2:30100" and fleet.slots[0].state == "serving"


def test_each_node_of_an_engine_is_launched_with_its_rank_and_the_first_nodes_address(monkeypatch):
    import ray

    from slime.ray.rollout_manager import manager

    class Actor:
        def __init__(self, address):
            self.dist_init_addr = type("Method", (), {"remote": staticmethod(lambda: address)})

    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: list(refs))
    nodes = manager.engine_nodes_of([[Actor("10.0.0.2:29555"), Actor("unused"), Actor("unused")], [Actor("x")]],
                                    timeout_s=5)
    assert [(n.nnodes, n.node_rank, n.dist_init_addr) for n in nodes[0]] == [
        (3, 0, "10.0.0.2:29555"), (3, 1, "10.0.0.2:29555"), (3, 2, "10.0.0.2:29555")]
    assert nodes[1] == [None]  # an engine within one node is launched as before


def test_the_embedded_engine_refuses_a_multi_node_launch():
    from slime.backends.sglang_utils.launcher import EngineNodes, launch_engine
    from slime.config import defaults_namespace

    with pytest.raises(ValueError, match="embedded engine is one process and cannot span 2 nodes"):
        launch_engine("embedded", defaults_namespace(), 0, 0, "/model",
                      nodes=EngineNodes(nnodes=2, node_rank=0, dist_init_addr="10.0.0.2:1"))
