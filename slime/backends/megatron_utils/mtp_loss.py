"""The multi-token-prediction loss of one packed micro-batch, weighted as the main loss is.

MTP depth k (1-based) at position t predicts the target of position t + k of the same sequence (labels[t] is token
t+1, so depth k predicts token t+k+1). Its cross-entropy counts with the weight loss.py gives that target position
(`token_weights`: the step's per-token or per-sample denominator, from the plan), so the term is a plain sum like the
main loss and needs no reduction of its own: the gradient is normalised where the main loss's is, and the reported
`mtp_loss` rides in the step's one metric all-reduce. The term is scaled by --mtp-loss-scaling-factor / D (megatron's
and upstream's weighting of the D depths).

Context parallelism is refused with MTP before Ray starts (megatron's MTP shifts tokens across CP ranks with
point-to-point messages the fenced step does not record), so the packed batch here holds whole sequences.
"""

from __future__ import annotations

from typing import Any

import torch

from slime.backends.megatron_utils.data import PackedMicroBatch
from slime.utils.ppo_utils import compute_log_probs

MTP_LOSS_KEY = "mtp_loss"


def split_output(output: torch.Tensor, depths: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(main logits, each MTP depth's logits) of an output stacked on the batch dimension (mtp_model.py); the
    output as it is when the MTP layers did not run (depths 0, or the forward-only passes)."""
    if depths == 0 or output.size(0) == 1:
        return output, ()
    main, *rest = output.chunk(1 + depths, dim=0)
    return main, tuple(rest)


def _shift_within_sequences(values: torch.Tensor, k: int, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """values[t + k] where t + k is in t's sequence, else 0."""
    positions = torch.arange(values.numel(), device=values.device)
    ends = cu_seqlens[1:].to(values.device).long()
    seq_end = ends[torch.searchsorted(ends, positions, right=True)]
    source = positions + k
    inside = source < seq_end
    shifted = values[source.clamp(max=values.numel() - 1)]
    return torch.where(inside, shifted, torch.zeros_like(shifted))


def mtp_loss(depth_logits: tuple[torch.Tensor, ...], packed: PackedMicroBatch, weights: torch.Tensor,
             scaling_factor: float, tp_group: Any) -> torch.Tensor:
    """scaling_factor / D * sum over depths and positions of the weighted cross-entropy (all-reduces over TP)."""
    total = weights.new_zeros(())
    for k, logits in enumerate(depth_logits, start=1):
        flat = logits.reshape(-1, logits.size(-1)).float()
        targets = _shift_within_sequences(packed.labels, k, packed.cu_seqlens)
        token_weights = _shift_within_sequences(weights, k, packed.cu_seqlens)
        total = total - (compute_log_probs(flat, targets, tp_group) * token_weights).sum()
    return total * (scaling_factor / len(depth_logits))
