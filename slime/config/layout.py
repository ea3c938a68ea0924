"""The parallel layout of the training ranks: one frozen ``ParallelLayout`` built and checked by
``build_parallel_layout`` from the flags, and read wherever the code needs TP, PP, CP, EP, ETP, DP or the world
size. The parse-time check builds it first, so a layout that cannot tile the actor world stops before Ray starts.
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass
from typing import Any

from slime.config.errors import derive, fail


# The flags build_parallel_layout reads (world size from --actor-num-* unless the caller gives it).
LAYOUT_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel", "num_experts",
                "moe_router_topk", "actor_num_nodes", "actor_num_gpus_per_node")


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """The sizes of the training ranks' parallel groups, built once from the flags by build_parallel_layout."""

    tp: int
    """Tensor-parallel ranks that split each layer's weights (--tensor-model-parallel-size)."""
    pp: int
    """Pipeline stages that split the layers (--pipeline-model-parallel-size)."""
    cp: int
    """Context-parallel ranks that split each sequence (--context-parallel-size)."""
    ep: int
    """Expert-parallel ranks that split the experts of an MoE layer (--expert-model-parallel-size)."""
    etp: int
    """Tensor-parallel ranks of each expert (--expert-tensor-parallel-size, default: tp)."""
    world_size: int
    """Training ranks: --actor-num-nodes x --actor-num-gpus-per-node, or the world of a running group."""
    sequence_parallel: bool
    """Norms and dropout split along the sequence over the TP group (--sequence-parallel; off at tp 1)."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (megatron's interleaved schedule; no flag here, plug-ins may set it)."""

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model: tp x cp x pp."""
        return self.tp * self.cp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: world_size / (tp x cp x pp)."""
        return self.world_size // self.model_parallel_size

    @property
    def expert_dp(self) -> int:
        """Data-parallel ranks of the experts: world_size / (ep x etp x pp)."""
        return self.world_size // (self.ep * self.etp * self.pp)


def virtual_pipeline_size(args: Any) -> int | None:
    """Megatron's interleaved schedule: virtual stages per rank. Not a flag of the parser: only plug-ins that build
    their own args set it, so this is the one place that reads it with a fallback."""
    return getattr(args, "virtual_pipeline_model_parallel_size", None)


def build_parallel_layout(args: Any, *, world_size: int | None = None) -> ParallelLayout:
    """The layout of the flags (of ``world_size`` ranks; default: the actor GPUs the flags ask for), checked:
    raises ArgumentValidationError naming the flags when the sizes cannot tile the world."""
    world = args.actor_num_nodes * args.actor_num_gpus_per_node if world_size is None else world_size
    tp = args.tensor_model_parallel_size
    etp = tp if args.expert_tensor_parallel_size is None else args.expert_tensor_parallel_size
    layout = ParallelLayout(tp=tp, pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size,
                            ep=args.expert_model_parallel_size, etp=etp, world_size=world,
                            sequence_parallel=bool(args.sequence_parallel) and tp > 1,
                            vpp=virtual_pipeline_size(args))
    _check_model_parallel(layout, args, world_size is None)
    _check_expert_layout(layout, args)
    return layout


def _check_model_parallel(layout: ParallelLayout, args: Any, from_flags: bool) -> None:
    if layout.world_size % layout.model_parallel_size == 0:
        return
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    world = (f"actor world size {layout.world_size} (--actor-num-nodes {args.actor_num_nodes} x "
             f"--actor-num-gpus-per-node {args.actor_num_gpus_per_node})" if from_flags
             else f"world size {layout.world_size}")
    fail(f"{world} is not divisible by TP*CP*PP = {tp}*{cp}*{pp} = {layout.model_parallel_size}; "
         f"change the parallel sizes or the {'actor ' if from_flags else ''}GPU count")


def _check_expert_layout(layout: ParallelLayout, args: Any) -> None:
    """EP x ETP x PP must tile the world; EP must divide the experts; top-k at most the experts."""
    ep, etp, pp, world = layout.ep, layout.etp, layout.pp, layout.world_size
    if world % (ep * etp * pp):
        fail(f"actor world size {world} is not divisible by --expert-model-parallel-size {ep} x "
             f"--expert-tensor-parallel-size {etp} x --pipeline-model-parallel-size {pp} = {ep * etp * pp}; "
             "pick EP and ETP whose product with PP divides the actor GPU count")
    experts, topk = args.num_experts, args.moe_router_topk
    if experts is not None and experts % ep:
        fail(f"--expert-model-parallel-size {ep} does not divide --num-experts {experts}; use a divisor of {experts}")
    if experts is not None and topk is not None and topk > experts:
        fail(f"--moe-router-topk {topk} is above --num-experts {experts}; route each token to at most {experts} experts")


def check_parallel_layout(args: argparse.Namespace) -> None:
    """Parse time: build the layout (the checks above) and fill the sizes derived from it."""
    layout = build_parallel_layout(args)
    world, tp, cp, pp = layout.world_size, layout.tp, layout.cp, layout.pp
    args.actor_world_size = world
    args.world_size = world
    derive(args, "data_parallel_size", layout.dp,
           f"actor world {world} / (--tensor-model-parallel-size {tp} x --context-parallel-size {cp} x "
           f"--pipeline-model-parallel-size {pp})")
    if args.sequence_parallel and tp == 1:
        warnings.warn("--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabling it", stacklevel=4)
        args.sequence_parallel = False


def critic_counts(args: Any) -> tuple[int, int]:
    """The critic's (nodes, GPUs per node) with --advantage-estimator ppo: --critic-num-nodes and
    --critic-num-gpus-per-node, each the actor's when not given."""
    nodes, per_node = args.critic_num_nodes, args.critic_num_gpus_per_node
    return (args.actor_num_nodes if nodes is None else nodes,
            args.actor_num_gpus_per_node if per_node is None else per_node)


def critic_world_size(args: Any) -> int:
    nodes, per_node = critic_counts(args)
    return nodes * per_node


def critic_has_own_bundles(args: Any) -> bool:
    """A critic with the actor's counts shares the actor's bundles (rank r on the actor's rank r's); any other
    counts put it on bundles of its own."""
    return critic_counts(args) != (args.actor_num_nodes, args.actor_num_gpus_per_node)
