"""Policy-loss primitives per token: PPO's clipped surrogate (with dual clip), GSPO's per-sample ratio and
truncated importance sampling. Tensors are per-token and 1-D; only the sequence ratio may all-reduce, over the
context-parallel group it is given."""

from __future__ import annotations

import torch
import torch.distributed as dist

from slime.algorithms.registry import PolicyLossInputs


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token; ``ppo_kl`` = old_log_probs - log_probs.

    Returns (pg_losses, clipfrac) where clipfrac is 1.0 where the clipped branch won.
    ``eps_clip_c`` (dual clip, > 1) bounds the loss of negative-advantage tokens.
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(-ppo_kl)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_high) * advantages
    pg_losses = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"eps_clip_c must be > 1, got {eps_clip_c}")
        dual = torch.minimum(pg_losses, -eps_clip_c * advantages)
        pg_losses = torch.where(advantages < 0, dual, pg_losses)
    return pg_losses, clipfrac


def ppo_clip_loss(inputs: PolicyLossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy-loss term of PPO, GRPO, GSPO and REINFORCE++: the clipped surrogate of the (token or sample)
    ratio."""
    return compute_policy_loss(inputs.log_ratio, inputs.advantages, eps_clip=inputs.eps_clip,
                               eps_clip_high=inputs.eps_clip_high, eps_clip_c=inputs.eps_clip_c)


def sequence_mean_log_ratio(log_ratio: torch.Tensor, loss_mask: torch.Tensor, sample_weight: torch.Tensor,
                            lengths: list[int], cp_group: object = None) -> torch.Tensor:
    """GSPO: every token gets its sample's mean (old - new) log-ratio over the sample's loss tokens.

    ``lengths``: the consecutive positions of each sample here; ``sample_weight``: 1 / (loss tokens of the
    whole sample) on each of its positions. A sample's tokens may be spread over the ``cp_group`` ranks (None:
    all here), so the per-sample sums are all-reduced over it (backward all-reduces too: each rank's tokens feed
    every rank's copy of the ratio); every rank of the group must hold the same samples.
    """
    segments = torch.repeat_interleave(torch.arange(len(lengths), device=log_ratio.device),
                                       torch.tensor(lengths, device=log_ratio.device))
    sums = torch.zeros(len(lengths), dtype=log_ratio.dtype, device=log_ratio.device)
    sums = sums.index_add(0, segments, log_ratio * loss_mask)
    if cp_group is not None:
        from torch.distributed.nn.functional import all_reduce

        sums = all_reduce(sums, op=dist.ReduceOp.SUM, group=cp_group)
    return sums[segments] * sample_weight * loss_mask


def compute_tis_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    clip_high: float = 2.0,
    clip_low: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling (--use-tis): pi_train_old / pi_rollout, clamped.

    Corrects the mismatch between the rollout engine's and the trainer's probabilities.
    Returns (weights, clipfrac); weights carry no gradient.
    """
    ratio = torch.exp(old_log_probs.float() - rollout_log_probs.float()).detach()
    weights = ratio.clamp(min=clip_low, max=clip_high)
    return weights, (weights != ratio).float()
