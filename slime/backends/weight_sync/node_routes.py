"""Colocated across nodes: which trainer rank feeds which engines, per PP stage. Pure.

Colocated engines take their weights through same-host transports, so each node's engines are fed by ranks
of that node. The layout this rests on:

- trainer rank r runs on node r // G (G = --actor-num-gpus-per-node; placement.check_colocated_nodes checks it),
  and every engine lies within one node (config/checks/run.py);
- megatron orders ranks tp-cp-dp-pp (pp outermost), so PP stage s holds the contiguous ranks s*B .. s*B+B-1
  (B = world / PP), and a TP group lies within one node because TP divides G (config/checks/run.py).

Every TP group of a stage holds the whole stage (CP and DP replicate it; EP's experts are all-gathered by every
rank's export), so for every stage s and every node n that holds some of s, the first TP group of s on n exports
it and its TP rank 0, the group's first rank, is n's *node sender* of s: it feeds n's engines through the
same-host transport. A node that holds none of s (PP spanning nodes) gets s over a weight-update group: the
nodes lacking s are dealt round-robin to s's node senders, each broadcasting to the engines of its share. With
whole replicas on every node (PP 1, or PP within a node) no node lacks a stage and no group is formed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence
from urllib.parse import urlparse


@dataclass(frozen=True, kw_only=True)
class NodeGrid:
    """The trainer's ranks over nodes and PP stages, colocated across nodes."""

    world: int
    gpus_per_node: int
    """Trainer ranks per node (--actor-num-gpus-per-node)."""
    tp: int
    pp: int

    @classmethod
    def from_args(cls, args: Any) -> "NodeGrid | None":
        """The grid when `--colocate` spans nodes (each node feeds its own engines), else None."""
        if not (args.colocate and args.actor_num_nodes > 1):
            return None
        per_node = args.actor_num_gpus_per_node
        return cls(world=args.actor_num_nodes * per_node, gpus_per_node=per_node,
                   tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size)

    @property
    def nodes(self) -> int:
        return self.world // self.gpus_per_node

    @property
    def stage_size(self) -> int:
        return self.world // self.pp

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def stage_of(self, rank: int) -> int:
        return rank // self.stage_size

    def stage_nodes(self, stage: int) -> tuple[int, ...]:
        """The nodes holding some rank of `stage`."""
        first, last = stage * self.stage_size, (stage + 1) * self.stage_size - 1
        return tuple(range(self.node_of(first), self.node_of(last) + 1))

    def node_sender(self, stage: int, node: int) -> int:
        """The first rank of `stage` on `node` (a TP rank 0: stages and nodes both start at a TP group)."""
        return max(stage * self.stage_size, node * self.gpus_per_node)

    def heads_export(self, rank: int) -> bool:
        """`rank` is in the TP group that exports its stage for its node."""
        return rank - rank % self.tp == self.node_sender(self.stage_of(rank), self.node_of(rank))

    def is_sender(self, rank: int) -> bool:
        return rank == self.node_sender(self.stage_of(rank), self.node_of(rank))

    @property
    def stages_span_nodes(self) -> bool:
        """Some node holds none of some stage: that stage reaches it over a weight-update group."""
        return any(len(self.stage_nodes(stage)) < self.nodes for stage in range(self.pp))

    def remote_nodes(self, rank: int) -> tuple[int, ...]:
        """The nodes holding none of `rank`'s stage whose engines `rank` feeds over the stage's group (empty
        unless `rank` is a node sender)."""
        if not self.is_sender(rank):
            return ()
        holders = self.stage_nodes(self.stage_of(rank))
        lacking = [node for node in range(self.nodes) if node not in holders]
        share = holders.index(self.node_of(rank))
        return tuple(node for i, node in enumerate(lacking) if i % len(holders) == share)


@dataclass(frozen=True)
class NodeFeeds:
    """The engines one node sender feeds: its node's (same-host transport) and those of its share of the nodes
    that hold none of its stage (the stage's weight-update group)."""

    local: tuple[str, ...]
    remote: tuple[str, ...]


def engines_of_node(engine_urls: Sequence[str], node_host: str | None) -> tuple[str, ...]:
    """The engines listening at this node's address: an engine's URL carries its node's address."""
    if not node_host:
        raise ValueError("colocated across nodes, a sender must know its node's address to find its engines")
    mine = tuple(url for url in engine_urls if urlparse(url).hostname == node_host.strip("[]"))
    if not mine:
        raise ValueError(f"no engine listens at this node's address {node_host} (engines: {list(engine_urls)}); "
                         "colocated engines must run on every node that holds trainer ranks")
    return mine


def node_feeds(grid: NodeGrid, rank: int, engine_urls: Sequence[str], node_host: str | None,
               node_hosts: Sequence[str]) -> NodeFeeds:
    """What node sender `rank` (on the node at `node_host`) feeds; `node_hosts`: every node's address, by node
    index (the driver's placement), needed only where the rank feeds other nodes."""
    local = engines_of_node(engine_urls, node_host)
    remote_nodes = grid.remote_nodes(rank)
    if not remote_nodes:
        return NodeFeeds(local, ())
    if len(node_hosts) != grid.nodes or node_hosts[grid.node_of(rank)] != node_host:
        raise ValueError(f"rank {rank} at {node_host} feeds nodes {list(remote_nodes)}, but the placement's node "
                         f"addresses {list(node_hosts)} do not list its node {grid.node_of(rank)} at that address")
    remote = tuple(url for node in remote_nodes for url in engines_of_node(engine_urls, node_hosts[node]))
    return NodeFeeds(local, remote)
