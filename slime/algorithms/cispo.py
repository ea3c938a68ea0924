"""CISPO (MiniMax-M1, `--advantage-estimator cispo`): GRPO's advantages with a clipped importance-sampling
objective. The whole estimator is this module and its line in registry.py."""

from __future__ import annotations

from typing import Any

import torch

from slime.algorithms.grpo import grpo_advantages
from slime.algorithms.registry import Estimator, PolicyLossInputs, register


def compute_cispo_loss(
    ppo_kl: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): -sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * log pi per token.

    The clipped importance weight carries no gradient, so every token keeps its log-prob's
    gradient (scaled by the weight) instead of being cut off as PPO's clip does; ``ppo_kl``
    = old_log_probs - log_probs. Returns (pg_losses, clipfrac: 1.0 where the weight was clipped).
    """
    ratio = torch.exp(-ppo_kl.detach())
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    return -weight * advantages * log_probs, (weight != ratio).float()


def cispo_loss(inputs: PolicyLossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's policy-loss term on the masked log-probs."""
    return compute_cispo_loss(inputs.log_ratio, inputs.log_probs * inputs.loss_mask, inputs.advantages,
                              eps_clip=inputs.eps_clip, eps_clip_high=inputs.eps_clip_high)


def refuse_dual_clip(args: Any) -> None:
    if args.eps_clip_c is not None:
        raise ValueError("--eps-clip-c (dual clip) bounds PPO's surrogate, which CISPO does not use; drop it (CISPO "
                         "clips its importance weight with --eps-clip / --eps-clip-high)")


CISPO = register(Estimator(name="cispo", advantages=grpo_advantages, policy_loss=cispo_loss,
                           group_normalised=True, std_normalised=True, check_flags=refuse_dual_clip))
