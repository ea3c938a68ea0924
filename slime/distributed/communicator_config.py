"""NCCL settings of communicators whose group holds one rank: one channel instead of NCCL's default.

A group of one rank moves no bytes between GPUs, yet NCCL gives its communicator as many channels
(and channel buffers) as any other: on one H200 a world-of-one communicator takes 0.54 GiB outside
PyTorch's allocator and each further one 0.38 GiB (benchmarks/RESULTS.md), which a colocated trainer
keeps while asleep. With `maxCTAs = 1` (megatron's per-group-kind `max_ctas`, `ncclConfig_t.maxCTAs`) such
a communicator is created small once and stays small: nothing is released at sleep and nothing is
re-created at wake. Groups that span ranks keep NCCL's defaults.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import Iterator

import torch
import yaml

# megatron-core's parallel_state group kinds (the keys of --nccl-communicator-config-path)
ALL_GROUP_KINDS = ("tp", "pp", "cp", "hcp", "dp", "dp_cp", "intra_dp_cp", "mp", "embd", "pos_embd", "tp_cp",
                   "tp_dp", "tp_dp_cp", "ep", "ep_tp", "tp_ep_mp", "tp_ep_pp", "ep_dp", "intra_ep_dp",
                   "inter_ep_dp", "intra_dist_opt_instance")


def single_rank_group_kinds(*, world_size: int, tensor: int, pipeline: int, context: int,
                            expert: int) -> tuple[str, ...]:
    """The group kinds whose every group holds one rank in this layout."""
    if world_size == 1:
        return ALL_GROUP_KINDS
    data = world_size // (tensor * pipeline * context)
    sizes = {"tp": tensor, "pp": pipeline, "cp": context, "dp": data, "dp_cp": data * context,
             "mp": tensor * pipeline, "tp_cp": tensor * context, "tp_dp": tensor * data,
             "tp_dp_cp": tensor * data * context, "ep": expert, "embd": pipeline, "pos_embd": pipeline}
    return tuple(kind for kind, size in sizes.items() if size == 1)


@contextmanager
def megatron_config_file(kinds: tuple[str, ...], max_ctas: int) -> Iterator[str | None]:
    """A --nccl-communicator-config-path file capping `kinds` at `max_ctas`, for the duration of
    megatron's group creation (None: nothing to cap)."""
    if not kinds or max_ctas <= 0:
        yield None
        return
    fd, path = tempfile.mkstemp(prefix="nccl_communicators_", suffix=".yaml")
    try:
        with os.fdopen(fd, "w") as out:
            yaml.safe_dump({kind: {"max_ctas": max_ctas, "min_ctas": 1} for kind in kinds}, out)
        yield path
    finally:
        os.unlink(path)


def world_group_options(world_size: int, max_ctas: int):
    """ProcessGroupNCCL options for a world of one rank (None: NCCL's defaults)."""
    if world_size != 1 or max_ctas <= 0:
        return None
    options = torch.distributed.ProcessGroupNCCL.Options()
    options.config.max_ctas = max_ctas
    options.config.min_ctas = 1
    return options
