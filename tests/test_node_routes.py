"""Colocated across nodes, who feeds which engine (pure): every node's engines get every PP stage exactly once,
from a rank of their own node when the node holds the stage, else over the stage's weight-update group; the
ranks' stages and TP groups are megatron's own."""
from __future__ import annotations

import types

import pytest
from megatron.core.parallel_state import RankGenerator

from slime.backends.weight_sync.node_routes import NodeGrid, engines_of_node, node_feeds

# (nodes, GPUs per node, TP, CP, PP): upstream's multi-node colocated launchers, then smaller and uneven ones
LAYOUTS = [
    (16, 8, 8, 4, 4),  # scripts/run-deepseek-r1.sh: a stage over 4 nodes, a node holds one CP rank of one stage
    (32, 8, 8, 4, 8),  # scripts/run-kimi-k2-*.sh
    (32, 8, 4, 2, 4),  # scripts/run-glm5-744B-A40B.sh: 8 nodes a stage, 2 TP groups a node
    (2, 4, 2, 2, 2),  # tests/test_multinode_end_to_end.py's colocated run: a stage per node
    (3, 8, 4, 1, 2),  # a node split between two stages (stages of 12 ranks over nodes of 8)
    (2, 8, 2, 2, 1),  # whole replicas on every node: no groups
    (2, 8, 2, 1, 4),  # PP within a node: no groups
]


def _grid(nodes, per_node, tp, cp, pp) -> NodeGrid:
    return NodeGrid.from_args(types.SimpleNamespace(colocate=True, actor_num_nodes=nodes, actor_num_gpus_per_node=per_node,
                                                    tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))


def _feeders(grid: NodeGrid) -> dict[tuple[int, int], list[tuple[int, str]]]:
    """(node, stage) -> [(sender rank, 'local' | 'remote')] over every sender."""
    fed: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for rank in range(grid.world):
        if grid.is_sender(rank):
            stage = grid.stage_of(rank)
            fed.setdefault((grid.node_of(rank), stage), []).append((rank, "local"))
            for node in grid.remote_nodes(rank):
                fed.setdefault((node, stage), []).append((rank, "remote"))
    return fed


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{n}x{g}-tp{t}-cp{c}-pp{p}" for n, g, t, c, p in LAYOUTS])
def test_every_node_gets_every_stage_once_from_an_exporting_tp_group(layout):
    nodes, per_node, tp, cp, pp = layout
    grid = _grid(*layout)
    world = nodes * per_node
    megatron = RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    stage_of = {rank: stage for group in megatron.get_ranks("pp") for stage, rank in enumerate(group)}
    tp_groups = {rank: tuple(group) for group in megatron.get_ranks("tp") for rank in group}
    assert all(grid.stage_of(rank) == stage_of[rank] for rank in range(world))
    fed = _feeders(grid)
    assert sorted(fed) == [(node, stage) for node in range(nodes) for stage in range(pp)]
    for (node, stage), feeders in fed.items():
        assert len(feeders) == 1, (node, stage, feeders)  # one sender a stage: no engine gets two pushes at once
        sender, how = feeders[0]
        holds = node in grid.stage_nodes(stage)
        assert how == ("local" if holds else "remote")
        group = tp_groups[sender]
        assert group[0] == sender and {grid.node_of(r) for r in group} == {grid.node_of(sender)}
        assert all(grid.heads_export(r) for r in group)  # the sender's whole TP group runs the export's gathers
        if holds:
            assert grid.node_of(sender) == node
    # exactly one exporting TP group per (stage, node holding it)
    assert sum(grid.heads_export(r) for r in range(world)) == tp * sum(len(grid.stage_nodes(s)) for s in range(pp))
    assert grid.stages_span_nodes == any(how == "remote" for f in fed.values() for _, how in f)


def test_remote_nodes_are_dealt_round_robin_to_the_stage_senders():
    grid = _grid(16, 8, 8, 4, 4)  # deepseek-r1: stage 0 on nodes 0-3, 12 nodes lack it
    assert grid.stage_nodes(0) == (0, 1, 2, 3) and [grid.node_sender(0, n) for n in range(4)] == [0, 8, 16, 24]
    assert [grid.remote_nodes(r) for r in (0, 8, 16, 24)] == [(4, 8, 12), (5, 9, 13), (6, 10, 14), (7, 11, 15)]
    assert grid.remote_nodes(1) == () and not grid.is_sender(1)
    glm5 = _grid(32, 8, 4, 2, 4)  # two TP groups a node: the second (ranks 4-7) neither exports nor sends
    assert glm5.is_sender(0) and not glm5.is_sender(4) and not glm5.heads_export(4)
    whole = _grid(2, 8, 2, 2, 1)  # whole replicas: each node's first TP group, as before
    assert [r for r in range(16) if whole.is_sender(r)] == [0, 8] and not whole.stages_span_nodes
    assert NodeGrid.from_args(types.SimpleNamespace(colocate=True, actor_num_nodes=1)) is None
    assert NodeGrid.from_args(types.SimpleNamespace(colocate=False, actor_num_nodes=2)) is None


def test_node_feeds_find_the_engines_by_their_node_address():
    urls = ["http://10.0.0.1:3000", "http://10.0.0.2:3000", "http://10.0.0.1:3001", "http://[fd00::2]:3000"]
    assert engines_of_node(urls, "10.0.0.1") == ("http://10.0.0.1:3000", "http://10.0.0.1:3001")
    assert engines_of_node(urls, "fd00::2") == ("http://[fd00::2]:3000",)
    with pytest.raises(ValueError, match="no engine listens at this node's address 10.0.0.9"):
        engines_of_node(urls, "10.0.0.9")
    grid = _grid(2, 4, 2, 2, 2)  # a stage per node: rank 0 feeds node 0 by tensor, node 1 over stage 0's group
    hosts = ("10.0.0.1", "10.0.0.2")
    feeds = node_feeds(grid, 0, urls[:3], "10.0.0.1", hosts)
    assert feeds.local == ("http://10.0.0.1:3000", "http://10.0.0.1:3001") and feeds.remote == ("http://10.0.0.2:3000",)
    assert node_feeds(grid, 4, urls[:3], "10.0.0.2", hosts).remote == ("http://10.0.0.1:3000", "http://10.0.0.1:3001")
    with pytest.raises(ValueError, match="do not list its node 0 at that address"):
        node_feeds(grid, 0, urls[:3], "10.0.0.1", ("10.0.0.2", "10.0.0.1"))
    whole = _grid(2, 4, 2, 2, 1)  # no node lacks a stage: the node addresses are not needed
    assert node_feeds(whole, 4, urls[:3], "10.0.0.2", ()).remote == ()


def test_a_node_sender_sends_each_bucket_to_its_node_then_over_its_stage_group():
    from slime.backends.weight_sync.transport import NodeSplitTransport

    calls = []

    class Half:
        def __init__(self, name):
            self.name, self.connected = name, False

        def connect(self):
            calls.append((self.name, "connect"))
            self.connected = True

        def send(self, index, tensors, *, version, flush_cache):
            calls.append((self.name, index, version, flush_cache))

        def close(self):
            calls.append((self.name, "close"))

    local_only = NodeSplitTransport(Half("local"), None)
    assert local_only.connected  # no group to form: no connect in the ledger
    split = NodeSplitTransport(Half("local"), Half("remote"))
    assert not split.connected
    split.connect()
    split.send(0, [], version=None, flush_cache=False)
    split.send(1, [], version="3", flush_cache=True)  # the version moves with the last bucket on both halves
    split.close()
    assert calls == [("remote", "connect"), ("local", 0, None, False), ("remote", 0, None, False),
                     ("local", 1, "3", True), ("remote", 1, "3", True), ("local", "close"), ("remote", "close")]
