"""The multi-token-prediction loss of one packed micro-batch, weighted as the main loss is.

MTP depth k (1-based) at position t predicts the target of position t + k of the same sequence (labels[t] is token
t+1, so depth k predicts token t+k+1). Its cross-entropy counts with the weight loss.py gives that target position
(`token_weights` of the mask shifted by k: the step's per-token or per-sample denominator, from the plan), so the term
is a plain sum like the main loss and needs no reduction of its own: the gradient is normalised where the main
loss's is, and the reported `mtp_loss` rides in the step's one metric all-reduce. The term is scaled by
--mtp-loss-scaling-factor / D (megatron's and upstream's weighting of the D depths).

The shifted targets and masks come with the packed batch (`PackedMicroBatch.mtp_tokens` / `mtp_loss_mask`), shifted
on the whole sequence before its context-parallel slice: under CP the target of a chunk's last positions lives in
another chunk, often on another rank, and is read from the rollout data every rank holds instead of being sent.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from slime.backends.megatron_utils.data import PackedMicroBatch
from slime.algorithms.log_probs import compute_log_probs

MTP_LOSS_KEY = "mtp_loss"


def split_output(output: torch.Tensor, depths: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(main logits, each MTP depth's logits) of an output stacked on the batch dimension (mtp_model.py); the
    output as it is when the MTP layers did not run (depths 0, or the forward-only passes)."""
    if depths == 0 or output.size(0) == 1:
        return output, ()
    main, *rest = output.chunk(1 + depths, dim=0)
    return main, tuple(rest)


def mtp_loss(depth_logits: tuple[torch.Tensor, ...], packed: PackedMicroBatch,
             weights_of: Callable[[torch.Tensor], torch.Tensor], scaling_factor: float, tp_group: Any) -> torch.Tensor:
    """scaling_factor / D * sum over depths and positions of the weighted cross-entropy (all-reduces over TP);
    ``weights_of(mask)``: the loss's token weights of a loss mask."""
    total = packed.loss_mask.new_zeros(())
    for k, logits in enumerate(depth_logits, start=1):
        flat = logits.reshape(-1, logits.size(-1)).float()
        log_probs = compute_log_probs(flat, packed.mtp_tokens[k], tp_group)
        total = total - (log_probs * weights_of(packed.mtp_loss_mask[k - 1])).sum()
    return total * (scaling_factor / len(depth_logits))
