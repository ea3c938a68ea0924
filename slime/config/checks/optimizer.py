"""The optimizer's placement: --optimizer-cpu-offload and what it needs."""

from __future__ import annotations

import argparse
import warnings

from slime.config.errors import derive, fail


def resolve_optimizer_offload(args: argparse.Namespace) -> None:
    """megatron-core's hybrid CPU optimizer holds precision-aware state of 16-bit parameters, which lives only in its
    distributed optimizer: --optimizer-cpu-offload turns that on, and bf16 where no precision was asked for (upstream's
    trainer always has both). fp32 training cannot offload: megatron's distributed optimizer hands the hybrid optimizer
    views of fp32 weights, which a torch optimizer refuses to hold ("can't optimize a non-leaf Tensor")."""
    if not 0.0 <= args.optimizer_offload_fraction <= 1.0:
        fail(f"--optimizer-offload-fraction must be within [0, 1], got {args.optimizer_offload_fraction}")
    if not args.optimizer_cpu_offload:
        return
    if not args.use_distributed_optimizer:
        derive(args, "use_distributed_optimizer", True, "--optimizer-cpu-offload")
    if not (args.bf16 or args.fp16):
        derive(args, "bf16", True, "--optimizer-cpu-offload")
        warnings.warn("--optimizer-cpu-offload: training in bf16, as upstream's trainer always does (the hybrid CPU "
                      "optimizer holds 16-bit parameters only; fp32 is this project's default): pass --bf16 to say so",
                      stacklevel=3)
