"""`python train.py` on a Ray cluster of two nodes: where ranks and engines land, and the push.

The cluster is Ray's own multi-node test cluster on this machine (tests/ray_cluster.py), the second
node on its own loopback address (127.0.0.2) where the machine allows it. train.py is started the way
a user starts it on the head after `ray start --head`: no RAY_ADDRESS, it finds the cluster by the
address file `ray start` leaves. The layout is the smallest that shows the point: 2 trainer ranks and
`--rollout-num-gpus 2`, two CPUs per node: the ranks fill one node, the engines the other, so every
weight push crosses nodes. (`--colocate` across nodes is refused at parse time: colocated engines take
their weights from a rank on their own host; tests/test_placement.py places that layout on fake GPUs.)

An engine on the other node is reachable only at its node's address (it listens there), for
generation and for the weight push, whose version check covers every engine.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from ray_cluster import RayTestCluster, second_loopback_address
from train_runs import read_events, run_train

pytestmark = pytest.mark.e2e

LAYOUTS = {
    "separate": (2, ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"]),
}


def small_job_flags(root: Path) -> list[str]:
    return [
        "--hf-checkpoint", str(root / "tiny-qwen3"),
        "--prompt-data", str(root / "prompts.jsonl"), "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rm-type", "math",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-steps-per-rollout", "1",
        "--rollout-max-response-len", "8", "--advantage-estimator", "grpo",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--lr", "1e-4", "--seed", "1234",
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
        "--use-slime-router", "--rollout-num-gpus-per-engine", "1", "--num-rollout", "2", "--fence-timeout", "120",
    ]


@pytest.fixture(scope="module")
def job_files(tmp_path_factory) -> Path:
    from slime.tools.demo_prompts import write_prompts
    from slime.tools.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("two-node")
    write_tiny_checkpoint(root / "tiny-qwen3")
    write_prompts(root / "prompts.jsonl", n=8, seed=0)
    return root


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def two_node_run(request, job_files):
    cpus_per_node, layout = LAYOUTS[request.param]
    second_ip = second_loopback_address()
    nodes = [{"num_cpus": cpus_per_node},
             {"num_cpus": cpus_per_node, **({"node_ip_address": second_ip} if second_ip else {})}]
    metrics = job_files / f"{request.param}.jsonl"
    with RayTestCluster(nodes) as cluster:
        # As on a cluster's head after `ray start --head`: no RAY_ADDRESS, the address file finds it.
        proc, seconds = run_train([*small_job_flags(job_files), *layout, "--metrics-jsonl", str(metrics)],
                                  timeout_s=600, env_extra={**cluster.env, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = read_events(metrics)
    return {"layout": request.param, "events": events, "placement": events["placement"][0], "second_ip": second_ip}


@pytest.mark.timeout(720)
def test_two_node_run_trains_and_pushes_weights_to_every_engine(two_node_run):
    events = two_node_run["events"]
    assert [e["rollout_id"] for e in events["train"]] == [0, 1]
    assert all(math.isfinite(e["train/loss"]) for e in events["train"])
    # The version check inside each sync reads every engine's weight_version, on both nodes
    # (version 0: the start-up sync of the trainer's initial weights).
    assert [e["weight_sync/version"] for e in events["weight_sync"]] == [0, 1, 2]
    assert all(e["weight_sync/bytes"] > 0 for e in events["weight_sync"])


def test_ranks_and_engines_landed_where_the_layout_puts_them(two_node_run):
    placement = two_node_run["placement"]
    ranks, engines = placement["placement/ranks"], placement["placement/engines"]
    rank_nodes, engine_nodes = [r["node_id"] for r in ranks], [e["node_id"] for e in engines]
    assert placement["placement/nodes"] == 2
    # the ranks on one node, the engines on the other: every push crosses nodes
    assert len(set(rank_nodes)) == 1 and len(set(engine_nodes)) == 1 and set(rank_nodes) != set(engine_nodes)
    for engine in engines:  # each engine listens on, and is reached at, its own node's address
        assert engine["bind_host"] == engine["node_ip"]
        assert engine["url"].startswith(f"http://{engine['node_ip']}:")
    if two_node_run["second_ip"]:
        node_ips = {r["node_ip"] for r in ranks} | {e["node_ip"] for e in engines}
        assert two_node_run["second_ip"] in node_ips and len(node_ips) == 2
