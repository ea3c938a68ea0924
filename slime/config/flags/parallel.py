"""Flags of model parallelism (TP, PP, CP, EP, ETP, SP) and activation recomputation."""

from __future__ import annotations

import argparse


def add_megatron_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron parallel", "model parallelism and activation recomputation")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="tensor-parallel (TP) ranks that split each layer's weights")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline-parallel (PP) stages that split the layers")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="context-parallel (CP) ranks that split each sequence")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="expert-parallel (EP) ranks (MoE)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="tensor-parallel ranks of each expert (default: --tensor-model-parallel-size)")
    g.add_argument("--sequence-parallel", action="store_true", default=False,
                   help="split norms and dropout along the sequence over the TP group (SP)")
    g.add_argument("--use-distributed-optimizer", action="store_true", default=False,
                   help="shard the optimizer state over data-parallel ranks")
    g.add_argument("--overlap-grad-reduce", action="store_true", default=False,
                   help="overlap the data-parallel gradient reduce with backward")
    g.add_argument("--overlap-param-gather", action="store_true", default=False,
                   help="overlap the distributed optimizer's parameter gather with forward")
    g.add_argument("--recompute-granularity", type=str, default=None, choices=["full", "selective"],
                   help="recompute activations in backward to save memory")
    g.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"],
                   help="how layers are grouped for full recomputation")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="layers per recomputation unit")
