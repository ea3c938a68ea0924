"""Engines larger than a node: SGLang's multi-node launch, checked before Ray starts."""

from __future__ import annotations

import argparse

from slime.config.engine import pick_rollout_backend
from slime.config.errors import fail


def check_engine_span(args: argparse.Namespace) -> None:
    """An engine of more GPUs than a node gives engines (--num-gpus-per-node) runs one SGLang process on each of its
    nodes, which splits its tensor-parallel ranks evenly over them; the embedded engine is one process. (Colocated
    engines: config/checks/run.py.)"""
    if args.debug_train_only or args.colocate:
        return
    per_node, per_engine = args.num_gpus_per_node, args.rollout_num_gpus_per_engine
    if per_engine <= per_node:
        return
    where = f"an engine of --rollout-num-gpus-per-engine {per_engine} GPUs over nodes of --num-gpus-per-node {per_node}"
    if per_engine % per_node:
        fail(f"{where}: SGLang splits an engine's tensor-parallel ranks evenly over its nodes (--nnodes); use a "
             f"multiple of {per_node}, or at most {per_node}")
    if pick_rollout_backend(args) == "embedded":
        fail(f"{where}: the embedded engine is one process on one machine and cannot span nodes; use "
             f"--rollout-backend sglang (SGLang's multi-node launch) or at most {per_node} GPUs an engine")
