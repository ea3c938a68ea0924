"""The parallel layout of the training ranks: one frozen ``ParallelLayout`` built and checked once from the
flags, and read wherever the code needs TP, PP, CP, EP, ETP, DP or the world size.
"""

from __future__ import annotations

import argparse
import warnings

from slime.config.errors import derive, fail


def check_parallel_layout(args: argparse.Namespace) -> None:
    tp, cp, pp = args.tensor_model_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    model_parallel = tp * cp * pp
    if world % model_parallel:
        fail(
            f"actor world size {world} (--actor-num-nodes {args.actor_num_nodes} x --actor-num-gpus-per-node "
            f"{args.actor_num_gpus_per_node}) is not divisible by TP*CP*PP = {tp}*{cp}*{pp} = {model_parallel}; "
            "change the parallel sizes or the actor GPU count"
        )
    check_expert_layout(args, world)
    args.actor_world_size = world
    args.world_size = world
    derive(args, "data_parallel_size", world // model_parallel,
           f"actor world {world} / (--tensor-model-parallel-size {tp} x --context-parallel-size {cp} x "
           f"--pipeline-model-parallel-size {pp})")
    if args.sequence_parallel and tp == 1:
        warnings.warn("--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabling it", stacklevel=4)
        args.sequence_parallel = False


def check_expert_layout(args: argparse.Namespace, world: int) -> None:
    """EP x ETP x PP must tile the world; EP must divide the experts; top-k at most the experts."""
    ep, etp, pp = args.expert_model_parallel_size, args.expert_tensor_parallel_size, args.pipeline_model_parallel_size
    if world % (ep * etp * pp):
        fail(f"actor world size {world} is not divisible by --expert-model-parallel-size {ep} x "
             f"--expert-tensor-parallel-size {etp} x --pipeline-model-parallel-size {pp} = {ep * etp * pp}; "
             "pick EP and ETP whose product with PP divides the actor GPU count")
    experts, topk = args.num_experts, args.moe_router_topk
    if experts is not None and experts % ep:
        fail(f"--expert-model-parallel-size {ep} does not divide --num-experts {experts}; use a divisor of {experts}")
    if experts is not None and topk is not None and topk > experts:
        fail(f"--moe-router-topk {topk} is above --num-experts {experts}; route each token to at most {experts} experts")
