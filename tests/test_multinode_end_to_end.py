"""`python train.py` on a Ray cluster of two nodes: where ranks and engines land, and the push.

The cluster is Ray's own multi-node test cluster on this machine (tests/ray_cluster.py), the second
node on its own loopback address (127.0.0.2) where the machine allows it. train.py is started the way
a user starts it on the head after `ray start --head`: no RAY_ADDRESS, it finds the cluster by the
address file `ray start` leaves. The layout is the smallest that shows the point: 2 trainer ranks and
`--rollout-num-gpus 2`, two CPUs per node: the ranks fill one node, the engines the other, so every
weight push crosses nodes.

An engine on the other node is reachable only at its node's address (it listens there), for
generation and for the weight push, whose version check covers every engine.

The colocated run is examples/run_cpu_demo.sh spread over the two nodes: 8 CPU ranks (4 a node) as
TP2 x SP x CP2 x PP2, `--colocate`, one engine of 4 per node. Each node holds one PP stage: its rank feeds
that stage to its own node's engine through shared memory and to the other node's engine over the stage's
weight-update group, the stages one after another. It learns the counting task, the engines' log-probs
agree with the trainer's after every push, and its recorded collectives pass the order proof.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from ray_cluster import RayTestCluster, second_loopback_address
from train_runs import assert_reward_rises, read_events, run_script, run_train, write_run_assets

pytestmark = pytest.mark.e2e
# The colocated run: ~240 s in the suite on idle cores, 478 s once on a CI host under load. The deadline is for a hang.
RUN_TIMEOUT_S = 900

LAYOUTS = {
    "separate": (2, ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"]),
}


def small_job_flags(job_files: dict[str, Path]) -> list[str]:
    return [
        "--hf-checkpoint", str(job_files["checkpoint"]),
        "--prompt-data", str(job_files["prompts"]), "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rm-type", "math",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-steps-per-rollout", "1",
        "--rollout-max-response-len", "8", "--advantage-estimator", "grpo",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--lr", "1e-4", "--seed", "1234",
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
        "--use-slime-router", "--rollout-num-gpus-per-engine", "1", "--num-rollout", "2", "--fence-timeout", "120",
    ]


@pytest.fixture(scope="module")
def job_files(tmp_path_factory) -> dict[str, Path]:
    return write_run_assets(tmp_path_factory.mktemp("two-node"), prompts=8)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def two_node_run(request, job_files):
    cpus_per_node, layout = LAYOUTS[request.param]
    second_ip = second_loopback_address()
    nodes = [{"num_cpus": cpus_per_node},
             {"num_cpus": cpus_per_node, **({"node_ip_address": second_ip} if second_ip else {})}]
    metrics = job_files["root"] / f"{request.param}.jsonl"
    with RayTestCluster(nodes) as cluster:
        # As on a cluster's head after `ray start --head`: no RAY_ADDRESS, the address file finds it.
        proc, seconds = run_train([*small_job_flags(job_files), *layout, "--metrics-jsonl", str(metrics)],
                                  timeout_s=RUN_TIMEOUT_S, env_extra={**cluster.env, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = read_events(metrics)
    return {"layout": request.param, "events": events, "placement": events["placement"][0], "second_ip": second_ip}


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
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


# ----------------------------------------------------------------------------- colocated across the two nodes
COLOCATED_ROLLOUTS = 14
MIN_RISE = 0.2  # the one-node demo rises +0.40 to +0.45 over 20 rollouts (tests/test_learning_demo.py)
COLOCATED_FLAGS = ["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4", "--context-parallel-size", "2",
                   "--pipeline-model-parallel-size", "2", "--rollout-num-gpus-per-engine", "4",
                   "--ledger-record-sequence"]


@pytest.fixture(scope="module")
def colocated_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("colocated-two-node")
    second_ip = second_loopback_address()
    nodes = [{"num_cpus": 4}, {"num_cpus": 4, **({"node_ip_address": second_ip} if second_ip else {})}]
    with RayTestCluster(nodes) as cluster:
        run_script("run_cpu_demo.sh", out, timeout_s=RUN_TIMEOUT_S, num_rollout=COLOCATED_ROLLOUTS,
                   extra=[*COLOCATED_FLAGS, "--ledger-dir", str(out / "ledger")],
                   env_extra={**cluster.env, "RAY_ADDRESS": ""})
    return {"out": out, "events": read_events(out / "metrics.jsonl"), "second_ip": second_ip}


def _series(events: dict, kind: str, key: str) -> list[float]:
    return [e[key] for e in sorted(events[kind], key=lambda e: e["rollout_id"])]


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_colocated_over_two_nodes_each_engine_on_its_node(colocated_run):
    placement = colocated_run["events"]["placement"][0]
    ranks, engines = placement["placement/ranks"], placement["placement/engines"]
    assert placement["placement/nodes"] == 2 and len(ranks) == 8 and len(engines) == 2
    rank_nodes = [r["node_id"] for r in ranks]
    assert rank_nodes[:4] == [rank_nodes[0]] * 4 and rank_nodes[4:] == [rank_nodes[4]] * 4
    assert [e["node_id"] for e in engines] == [rank_nodes[0], rank_nodes[4]]  # one engine per node
    if colocated_run["second_ip"]:
        assert engines[1]["url"].startswith(f"http://{colocated_run['second_ip']}:")


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_colocated_over_two_nodes_learns_and_every_engine_follows(colocated_run):
    events = colocated_run["events"]
    assert_reward_rises(_series(events, "rollout", "rollout/raw_reward"), COLOCATED_ROLLOUTS, MIN_RISE)
    # every sync's version check reads both engines; the log-probs agree, so each node's engine got the weights
    assert _series(events, "weight_sync", "weight_sync/version") == list(range(COLOCATED_ROLLOUTS + 1))
    diffs = _series(events, "train", "train/train_rollout_logprob_abs_diff")
    assert all(0.0 <= d <= 1e-4 for d in diffs), diffs
    # and after every sync the weight-sync proof compared every tensor both engines serve with what the node
    # senders pushed (each stage's by tensor to its node's engine, over its group to the other node's)
    compared = _series(events, "weight_sync", "weight_sync/proof_tensors")
    assert len(set(compared)) == 1 and compared[0] > 0, compared


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_colocated_over_two_nodes_order_proof_holds(colocated_run):
    from slime.distributed.order_proof import check_order, read_sequences

    sequences = read_sequences(str(colocated_run["out"] / "ledger"))
    assert len(sequences) == 8
    report = check_order(sequences)
    assert report.ok, report.format()
    # one sender per node and stage (its TP rank 0): rank 0 holds stage 0 on node 0, rank 4 stage 1 on node 1
    senders = {rank for rank, seq in sequences.items() if any(op.op.startswith("weight_sync/send_bucket")
                                                               for op in seq.ops)}
    assert senders == {0, 4}
    # each forms its stage's weight-update group with the other node's engine once, in its stage's turn
    connects = {rank: [op.op for op in seq.ops if op.op.startswith("weight_sync/connect_pp")]
                for rank, seq in sequences.items()}
    assert connects == {0: ["weight_sync/connect_pp0"], 4: ["weight_sync/connect_pp1"],
                        **{rank: [] for rank in (1, 2, 3, 5, 6, 7)}}
    # the group holds the other node's engine only (its own node's takes tensors): one engine, not both
    joined = {rank: [op.shape for op in sequences[rank].ops if op.op.startswith("weight_sync/connect_pp")]
              for rank in (0, 4)}
    assert joined == {0: [(1,)], 4: [(1,)]}, joined
