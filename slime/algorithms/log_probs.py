"""Log-probs and entropy from logits whose vocabulary may be sharded over a tensor-parallel group.

Pure except for the vocab-parallel path, which all-reduces over the group it is given.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def compute_log_probs(logits: torch.Tensor, tokens: torch.Tensor, process_group: Any = None) -> torch.Tensor:
    """log pi(token) from logits whose last dim may be a vocab shard of ``process_group``.

    With a group of size > 1 this is megatron's vocab-parallel cross entropy (which
    all-reduces over the tensor-parallel group); it edits its input in place, so it gets
    a copy and ``logits`` stays usable for the entropy.
    """
    if process_group is None or dist.get_world_size(process_group) == 1:
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits.float().clone(), tokens)


def compute_entropy_from_logits(logits: torch.Tensor, process_group: Any = None) -> torch.Tensor:
    """Entropy of softmax(logits) per position; the vocab may be sharded over ``process_group``.

    H = log Z - sum_i p_i z_i. The sharded sums use megatron's reduce-from-TP mapping
    (all-reduce forward, identity backward): every TP rank computes the same loss, the
    convention megatron's vocab-parallel cross entropy uses too.
    """
    logits = logits.float()
    sharded = process_group is not None and dist.get_world_size(process_group) > 1
    shift = logits.detach().max(dim=-1, keepdim=True).values
    if sharded:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=process_group)
    shifted = logits - shift
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    sum_exp_z = (exp * shifted).sum(dim=-1)
    if sharded:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp, group=process_group)
        sum_exp_z = reduce_from_tensor_model_parallel_region(sum_exp_z, group=process_group)
    return torch.log(sum_exp) - sum_exp_z / sum_exp
