"""--save / --load with megatron.core.dist_checkpointing, and --hf-checkpoint loading.

Layout (megatron's): <dir>/iter_0000007/ (a torch_dist checkpoint) and
<dir>/latest_checkpointed_iteration.txt. Every rank of the world calls save/load together
(dist_checkpointing coordinates over the default group); resharding to another TP/PP/CP
layout on load is dist_checkpointing's job.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

import patches
from slime_plugins.models.hf_weights import export_hf_weights, load_hf_weights

__all__ = ["save_checkpoint", "load_checkpoint", "latest_iteration", "load_hf_weights", "export_hf_weights"]

_TRACKER = "latest_checkpointed_iteration.txt"
# Distributed-optimizer state format: Megatron-LM's default. The model itself reloads under any
# layout; optimizer state needs the same TP/PP (DP may change).
_SHARDING_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _model_sharded_state_dict(model_chunks: list) -> dict[str, Any]:
    if len(model_chunks) == 1:
        return {"model": _unwrap(model_chunks[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def _merged_model_sharded(model_state: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for state in model_state.values():
        merged.update(state)
    return merged


def _full_sharded_state_dict(model_chunks, optimizer, lr_scheduler, is_loading: bool) -> dict[str, Any]:
    state = _model_sharded_state_dict(model_chunks)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            _merged_model_sharded(state), is_loading=is_loading, metadata=_SHARDING_METADATA)
    if lr_scheduler is not None:
        state["opt_param_scheduler"] = lr_scheduler.state_dict()
    return state


def save_checkpoint(root: str, iteration: int, model_chunks: list, optimizer=None, lr_scheduler=None) -> str:
    """Save model (+ optimizer, scheduler) as iteration `iteration` under root. All ranks call."""
    patches.apply_all()  # dist_checkpointing modules imported since start get the CPU patch too
    from megatron.core import dist_checkpointing

    path = _iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    state = _full_sharded_state_dict(model_chunks, optimizer, lr_scheduler, is_loading=False)
    state["iteration"] = iteration
    dist_checkpointing.save(state, path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, _TRACKER), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    return path


def latest_iteration(root: str) -> Optional[int]:
    tracker = os.path.join(root, _TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        return int(f.read().strip())


@torch.no_grad()  # state copies into (views of) leaf params must not be recorded by autograd
def load_checkpoint(root: str, model_chunks: list, optimizer=None, lr_scheduler=None,
                    iteration: Optional[int] = None) -> int:
    """Load model (+ optimizer, scheduler) in place; returns the loaded iteration. All ranks call."""
    patches.apply_all()
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root) if iteration is None else iteration
    if iteration is None:
        raise FileNotFoundError(f"no {_TRACKER} under {root}")
    state = _full_sharded_state_dict(model_chunks, optimizer, lr_scheduler, is_loading=True)
    state["iteration"] = iteration
    loaded = dist_checkpointing.load(state, _iteration_dir(root, iteration))
    if len(model_chunks) == 1:
        _unwrap(model_chunks[0]).load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(model_chunks):
            _unwrap(chunk).load_state_dict(loaded[f"model{i}"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if lr_scheduler is not None:
        lr_scheduler.num_steps = 0  # its load_state_dict ADDS the saved step count
        lr_scheduler.load_state_dict(loaded["opt_param_scheduler"])
    return int(loaded.get("iteration", iteration))
