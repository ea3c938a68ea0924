"""`python train.py` on a Ray cluster of two nodes (issue 20): trainer ranks and engines on both.

The cluster is Ray's own multi-node test cluster on this machine (tests/ray_cluster.py), one
logical CPU per node, the second node on its own loopback address (127.0.0.2) where the machine
allows it. train.py is started the way a user starts it on the head after `ray start --head`: no
RAY_ADDRESS, it finds the cluster by the address file `ray start` leaves. With
`--actor-num-nodes 2 --actor-num-gpus-per-node 1 --colocate` each node holds one trainer rank and
one engine; the engine on the other node is reached only through its node's address (it listens
there), for generation and for the weight push, whose version check covers every engine.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from ray_cluster import RayTestCluster, second_loopback_address
from test_end_to_end import read_events, run_train

TWO_NODE_LAYOUT = [
    "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--colocate",
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
    "--use-slime-router", "--rollout-num-gpus-per-engine", "1",
]


def small_job_flags(root: Path) -> list[str]:
    return [
        "--hf-checkpoint", str(root / "tiny-qwen3"),
        "--prompt-data", str(root / "prompts.jsonl"), "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rm-type", "math",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-steps-per-rollout", "1",
        "--rollout-max-response-len", "8", "--advantage-estimator", "grpo",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--lr", "1e-4", "--seed", "1234",
        "--num-rollout", "2", "--fence-timeout", "120",
    ]


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory):
    from slime.tools.demo_prompts import write_prompts
    from slime.tools.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("two-node")
    write_tiny_checkpoint(root / "tiny-qwen3")
    write_prompts(root / "prompts.jsonl", n=8, seed=0)
    second_ip = second_loopback_address()
    nodes = [{"num_cpus": 1}, {"num_cpus": 1, **({"node_ip_address": second_ip} if second_ip else {})}]
    metrics = root / "metrics.jsonl"
    with RayTestCluster(nodes) as cluster:
        # As on a cluster's head after `ray start --head`: no RAY_ADDRESS, the address file finds it.
        proc, seconds = run_train([*small_job_flags(root), *TWO_NODE_LAYOUT, "--metrics-jsonl", str(metrics)],
                                  timeout_s=600, env_extra={**cluster.env, "RAY_ADDRESS": ""})
    return {"proc": proc, "metrics": metrics, "second_ip": second_ip, "seconds": seconds}


@pytest.mark.timeout(720)
def test_two_node_run_trains_and_pushes_weights_to_both_nodes(two_node_run):
    proc = two_node_run["proc"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = read_events(two_node_run["metrics"])
    assert [e["rollout_id"] for e in events["train"]] == [0, 1]
    assert all(math.isfinite(e["train/loss"]) for e in events["train"])
    # The version check inside each sync reads every engine's weight_version: both nodes' engines got it
    # (version 0: the start-up sync of the trainer's initial weights).
    assert [e["weight_sync/version"] for e in events["weight_sync"]] == [0, 1, 2]
    assert all(e["weight_sync/bytes"] > 0 for e in events["weight_sync"])


def test_ranks_and_engines_landed_on_both_nodes(two_node_run):
    assert two_node_run["proc"].returncode == 0, two_node_run["proc"].stderr[-4000:]
    placement = read_events(two_node_run["metrics"])["placement"][0]
    ranks, engines = placement["placement/ranks"], placement["placement/engines"]
    assert placement["placement/nodes"] == 2
    assert len({r["node_id"] for r in ranks}) == 2 and len({e["node_id"] for e in engines}) == 2
    # colocated: engine i shares trainer rank i's bundle, hence its node
    assert [e["node_id"] for e in engines] == [r["node_id"] for r in ranks]
    for engine in engines:  # each engine listens on, and is reached at, its own node's address
        assert engine["bind_host"] == engine["node_ip"]
        assert engine["url"].startswith(f"http://{engine['node_ip']}:")
    if two_node_run["second_ip"]:
        assert two_node_run["second_ip"] in {e["node_ip"] for e in engines}
        assert len({e["node_ip"] for e in engines}) == 2
