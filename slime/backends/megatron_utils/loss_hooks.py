"""Upstream's loss plug-ins on top of the packed, layout-invariant loss of loss.py.

Upstream hands its loss plug-ins per-sample lists of the CP-local response-token values;
`ResponseView` gives the same view of a packed micro-batch (and scatters results back):
- `--custom-tis-function-path`: `fn(args=, pg_loss=, train_log_probs=, rollout_log_probs=,
  loss_masks=, total_lengths=, response_lengths=) -> (pg_loss, loss_masks, metrics)`;
- `--custom-pg-loss-reducer-function-path`: `fn(total_lengths, response_lengths, loss_masks,
  calculate_per_token_loss) -> reducer`, `reducer(pg_loss) -> scalar`;
- `--loss-type custom_loss --custom-loss-function-path`: `fn(args, batch, logits,
  sum_of_sample_mean) -> (loss, metrics)`.
Here every micro-batch's loss is a contribution that is SUMMED over micro-batches and DP x CP
ranks (loss.py): `sum_of_sample_mean` returns exactly such a contribution, and a reducer or a
custom loss must return one too (e.g. a sum divided by a constant for Dr. GRPO).
Also here: GSPO's sequence-level importance ratio, which needs a sum over the CP group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from slime.algorithms import policy_loss
from slime.backends.megatron_utils.data import PADDING_SAMPLE_ID, PackedMicroBatch, zigzag_slice


@dataclass(frozen=True)
class ResponseView:
    """Where each sample's response tokens sit among this CP rank's packed positions."""

    positions: torch.Tensor
    """Local packed positions of the response tokens, sample after sample (long)."""
    sizes: tuple[int, ...]
    """Response tokens of each sample held on this CP rank."""
    total_lengths: tuple[int, ...]
    response_lengths: tuple[int, ...]

    @classmethod
    def of(cls, packed: PackedMicroBatch) -> "ResponseView":
        positions, sizes, totals, responses, offset = [], [], [], [], 0
        for sid, local, padded, total, response in zip(packed.sample_ids, packed.local_lengths, packed.padded_lengths,
                                                       packed.total_lengths, packed.response_lengths):
            if sid != PADDING_SAMPLE_ID:
                marks = torch.zeros(padded, dtype=torch.bool)
                first = total - response - 1  # position t carries the values of token t+1
                marks[first: first + response] = True
                local_marks = zigzag_slice(marks, packed.cp_size, _cp_rank(packed))
                here = local_marks.nonzero().flatten() + offset
                positions.append(here)
                sizes.append(int(here.numel()))
                totals.append(total)
                responses.append(response)
            offset += local
        flat = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
        return cls(flat.to(packed.loss_mask.device), tuple(sizes), tuple(totals), tuple(responses))

    def take(self, values: torch.Tensor) -> torch.Tensor:
        """Packed per-position values -> the concatenated response values."""
        return values[self.positions]

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        return list(self.take(values).split(list(self.sizes)))

    def scatter(self, concatenated: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Concatenated response values back to packed positions (0 elsewhere); keeps the autograd graph."""
        return torch.zeros_like(like, dtype=concatenated.dtype).index_put((self.positions,), concatenated)


def _cp_rank(packed: PackedMicroBatch) -> int:
    if packed.cp_size == 1:
        return 0
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_rank()


def load_hook(path: str) -> Callable[..., Any]:
    from slime.utils.misc import load_function

    return load_function(path)


# ------------------------------------------------------------------------------ GSPO


def sequence_mean_log_ratio(ppo_kl: torch.Tensor, packed: PackedMicroBatch) -> torch.Tensor:
    """GSPO's per-sample ratio (slime.algorithms.policy_loss) over this packed micro-batch: a sample's tokens are
    spread over the CP ranks, and every CP rank of a DP rank packs the same samples."""
    cp_group = None
    if packed.cp_size > 1:
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()
    return policy_loss.sequence_mean_log_ratio(ppo_kl, packed.loss_mask, packed.sample_weight, packed.local_lengths,
                                               cp_group)


# -------------------------------------------------------------------- custom TIS / RS


def custom_tis(path: str, args: Any, pg_loss: torch.Tensor, old_log_probs: torch.Tensor, packed: PackedMicroBatch,
               view: ResponseView) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(pg_loss per position, loss mask for the pg term per position, per-position metrics) from the plug-in."""
    if packed.rollout_log_probs is None:
        raise ValueError("--custom-tis-function-path needs 'rollout_log_probs' in the rollout data")
    new_pg, masks, metrics = load_hook(path)(
        args=args, pg_loss=view.take(pg_loss), train_log_probs=view.split(old_log_probs),
        rollout_log_probs=view.split(packed.rollout_log_probs), loss_masks=view.split(packed.loss_mask),
        total_lengths=list(view.total_lengths), response_lengths=list(view.response_lengths))
    returned = torch.cat([m.flatten() for m in masks]) if len(masks) else packed.loss_mask.new_zeros(0)
    mask = view.scatter(returned.to(packed.loss_mask.dtype), packed.loss_mask)
    per_position = {key: view.scatter(value.detach().flatten().float(), packed.loss_mask)
                    for key, value in (metrics or {}).items()}
    return view.scatter(new_pg, pg_loss), mask, per_position


# -------------------------------------------------------------------- custom reducer


def custom_pg_reducer(path: str, packed: PackedMicroBatch, view: ResponseView,
                      per_token: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The plug-in's reducer, applied to the concatenated response values of a per-position tensor."""
    reducer = load_hook(path)(list(view.total_lengths), list(view.response_lengths), view.split(packed.loss_mask),
                              per_token)
    return lambda per_position: reducer(view.take(per_position))


# -------------------------------------------------------------------- custom loss


def upstream_batch(packed: PackedMicroBatch, view: ResponseView, log_probs: torch.Tensor,
                   entropy: torch.Tensor) -> dict[str, Any]:
    """The micro-batch in upstream's per-sample form, plus the current policy's log-probs and entropy."""
    batch: dict[str, Any] = {
        "loss_masks": view.split(packed.loss_mask),
        "total_lengths": list(view.total_lengths),
        "response_lengths": list(view.response_lengths),
        "current_log_probs": view.split(log_probs),
        "entropy": view.split(entropy),
        "packed": packed,
    }
    for key, value in (("log_probs", packed.old_log_probs), ("ref_log_probs", packed.ref_log_probs),
                       ("advantages", packed.advantages), ("rollout_log_probs", packed.rollout_log_probs)):
        if value is not None:
            batch[key] = view.split(value)
    return batch


def custom_loss(path: str, args: Any, logits: torch.Tensor, packed: PackedMicroBatch, view: ResponseView,
                log_probs: torch.Tensor, entropy: torch.Tensor,
                weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)`; metrics are scalar contributions."""
    def sum_of_sample_mean(values: torch.Tensor) -> torch.Tensor:
        return (values * view.take(weights)).sum()

    loss, metrics = load_hook(path)(args, upstream_batch(packed, view, log_probs, entropy), logits, sum_of_sample_mean)
    # keep the graph connected on a micro-batch the plug-in gave nothing to (padding): backward must run
    loss = loss + 0.0 * logits.sum()
    return loss, {key: torch.as_tensor(value).detach().double().reshape(()) for key, value in (metrics or {}).items()}
