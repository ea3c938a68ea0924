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

from slime.config.run_config import run_groups
from slime.distributed.communicator_config import world_group_options
from slime.utils.deadlines import run_deadlines


def _timeout(args: Namespace) -> datetime.timedelta:
    """The world group's timeout: the process-group timeout, above every watchdog window."""
    return datetime.timedelta(seconds=run_deadlines(args).group_timeout)


def host_rendezvous(args: Namespace, world_size: int, host: str) -> dist.TCPStore:
    """Rank 0's rendezvous store on `host`, on a port the kernel picks as it binds (`.port`): no other
    process can take the port between choosing and binding it. Pass it to init_distributed as rank 0's `store`."""
    from slime.distributed.external_group import hosted_store

    return hosted_store(host, world_size, _timeout(args))


def join_rendezvous(args: Namespace, master_addr: str, master_port: int, world_size: int) -> dist.TCPStore:
    """The other ranks' side of `host_rendezvous` (waits for it up to the process-group timeout)."""
    return dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=_timeout(args))


def init_distributed(
    args: Namespace,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str | None = None,
    store: dist.Store | None = None,
) -> None:
    """Join the default process group (every wait bounded by the process-group timeout).

    backend: "nccl" or "gloo"; default --distributed-backend when CUDA is present, else gloo.
    store: rank 0's `host_rendezvous()`, the other ranks' `join_rendezvous()`; without it, torch's tcp://
    rendezvous at master_addr:master_port (torchrun's agent store under torchrun).
    """
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized")
    backend = backend or (args.distributed_backend if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        # LOCAL_RANK: the device of the rank's Ray bundle (slime/ray/driver/placement.py), or torchrun's;
        # without either, ranks share a host's GPUs in rank order.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    rendezvous = {"store": store} if store is not None else {"init_method": f"tcp://{master_addr}:{master_port}"}
    options = None
    if backend == "nccl":  # a world of one rank: one NCCL channel (slime/distributed/communicator_config.py)
        options = world_group_options(world_size, run_groups(args, world_size).single_rank_group_max_ctas)
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=_timeout(args),
                            pg_options=options, **rendezvous)


def init_model_parallel(args: Namespace) -> None:
    """Create megatron's TP/PP/CP/EP/DP groups (without fences: tests and tools) and seed the RNGs.

    The training actor creates the same groups through ProcessGroupLifecycle, which adds the
    fence group and the eager warm-up; both go through create_model_parallel_groups.
    """
    from slime import patches
    from slime.distributed.groups import create_model_parallel_groups

    patches.apply_all()
    create_model_parallel_groups(run_groups(args, dist.get_world_size()))
    seed_model_parallel(args)


def seed_model_parallel(args: Namespace) -> None:
    """megatron's convention: data-parallel state = args.seed, TP state = args.seed + 2718 + tp_rank.

    CPU runs use the CPU generator (slime/patches/megatron_core.py maps the CUDA RNG onto it). This is the
    state of a fresh start; a resume then restores every RNG as the checkpoint saved it
    (MegatronTrainActor._resume_rng, slime/checkpoint/rng.py).
    """
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
