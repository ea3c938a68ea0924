"""Process-group bring-up for the megatron trainer: torch.distributed, then megatron's groups.

Lifecycle (destroy/re-create around colocate sleep, warm-up, fences) belongs to slime/distributed;
these two functions are the single place a rank joins the world and builds its model-parallel groups.
"""

from __future__ import annotations

import datetime
import os
from argparse import Namespace

import torch
import torch.distributed as dist

from slime.utils.deadlines import DeadlineModel


def _timeout(args: Namespace) -> datetime.timedelta:
    """The world group's timeout: the process-group timeout, above every watchdog window."""
    return datetime.timedelta(seconds=DeadlineModel.from_args(args).group_timeout)


def init_distributed(
    args: Namespace,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str | None = None,
) -> None:
    """Join the default process group (every wait bounded by the process-group timeout).

    backend: "nccl" or "gloo"; default --distributed-backend when CUDA is present, else gloo.
    """
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized")
    backend = backend or (getattr(args, "distributed_backend", None) or "nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        # LOCAL_RANK: the device of the rank's Ray bundle (slime/ray/placement.py), or torchrun's;
        # without either, ranks share a host's GPUs in rank order.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=_timeout(args),
    )


def init_model_parallel(args: Namespace) -> None:
    """Create megatron's TP/PP/CP/EP/DP groups (without fences: tests and tools) and seed the RNGs.

    The training actor creates the same groups through ProcessGroupLifecycle, which adds the
    fence group and the eager warm-up; both go through create_model_parallel_groups.
    """
    import patches
    from slime.distributed.groups import ParallelLayout, create_model_parallel_groups

    patches.apply_all()
    create_model_parallel_groups(ParallelLayout.from_args(args))
    seed_model_parallel(args)


def seed_model_parallel(args: Namespace) -> None:
    """megatron's convention: data-parallel state = args.seed, TP state = args.seed + 2718 + tp_rank.

    CPU runs use the CPU generator (patches/megatron_core.py maps the CUDA RNG onto it). This is the
    state of a fresh start; a resume then restores every RNG as the checkpoint saved it
    (MegatronTrainActor._resume_rng, slime/checkpoint/rng.py).
    """
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(getattr(args, "seed", 1234))
