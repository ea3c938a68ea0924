"""Context-parallel helpers with upstream's names, for loss and TIS plug-ins that see CP-local values.

A sequence of `total_length` tokens is padded and cut into 2 x CP chunks; CP rank r holds chunks r and
2 x CP - 1 - r (zig-zag). Position t carries the values of token t + 1, so a response's values sit at
positions [total - response - 1, total - 1). A plug-in gets, per sample, the concatenation of the two
pieces of that range its rank holds (loss_hooks.ResponseView); these functions go between that and the
whole response. The padded length is the project's: a multiple of 2 x CP (times TP with
--sequence-parallel: pass `padded_total_length` then, as upstream's newer signature allows).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from slime.utils.misc import round_up


def _cp() -> tuple[int, int, object | None]:
    """(size, rank, group) of megatron's context-parallel group; (1, 0, None) before it exists."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0, None
    return (parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank(),
            parallel_state.get_context_parallel_group())


def response_slices(total_length: int, response_length: int, cp_size: int, cp_rank: int,
                    padded_total_length: int | None = None) -> tuple[slice, slice]:
    """The two pieces of the response (response coordinates) that CP rank `cp_rank` holds."""
    padded = padded_total_length or round_up(total_length, 2 * cp_size)
    if padded % (2 * cp_size) or padded < total_length:
        raise ValueError(f"padded length {padded} is not a multiple of 2*cp={2 * cp_size} holding {total_length}")
    chunk = padded // (2 * cp_size)
    first = total_length - response_length - 1
    pieces = []
    for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
        end = first + response_length
        lo = min(max(index * chunk, first), end)
        hi = max(min((index + 1) * chunk, end), lo)
        pieces.append(slice(lo - first, hi - first))
    return pieces[0], pieces[1]


def slice_log_prob_with_cp(log_prob: list[float] | torch.Tensor, total_length: int, response_length: int, *,
                           padded_total_length: int | None = None) -> list[float] | torch.Tensor:
    """This CP rank's part of a whole response's values (a list stays a list)."""
    if len(log_prob) != response_length:
        raise ValueError(f"{len(log_prob)} values for a response of {response_length} tokens")
    size, rank, _ = _cp()
    if size == 1:
        return log_prob
    first, second = response_slices(total_length, response_length, size, rank, padded_total_length)
    if isinstance(log_prob, list):
        return log_prob[first] + log_prob[second]
    return torch.cat([log_prob[first], log_prob[second]])


def all_gather_with_cp(tensor: torch.Tensor, total_length: int, response_length: int, *,
                       padded_total_length: int | None = None) -> torch.Tensor:
    """A whole response's values from every CP rank's part; differentiable (the gradient goes back to each part).

    One all-reduce over the CP group per call: every CP rank must call it for the same samples in the
    same order (plug-ins do, as they walk the same micro-batch).
    """
    size, rank, group = _cp()
    if size == 1:
        return tensor
    first, second = response_slices(total_length, response_length, size, rank, padded_total_length)
    held = (first.stop - first.start) + (second.stop - second.start)
    if tensor.size(0) != held:
        raise ValueError(f"CP rank {rank} holds {held} of the response's values, got {tensor.size(0)}")
    head, tail = tensor[: first.stop - first.start], tensor[first.stop - first.start:]
    zeros = lambda n: tensor.new_zeros((n, *tensor.shape[1:]))  # noqa: E731
    full = torch.cat([zeros(first.start), head, zeros(second.start - first.stop), tail,
                      zeros(response_length - second.stop)])
    return dist.nn.functional.all_reduce(full, group=group)
