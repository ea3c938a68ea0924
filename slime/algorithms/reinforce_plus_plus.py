"""REINFORCE++ and REINFORCE++-baseline: KL-shaped per-token returns, whitened over the whole rollout."""

from __future__ import annotations

from typing import Sequence

import torch

from slime.algorithms.policy_loss import ppo_clip_loss
from slime.algorithms.registry import AdvantageInputs, Estimator, register


def get_reinforce_plus_plus_returns(
    rewards: Sequence[float],
    kl: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    kl_coef: float,
    gamma: float = 1.0,
) -> list[torch.Tensor]:
    """REINFORCE++: token reward -kl_coef*kl, plus the sample reward on the last loss
    token; returns are the discounted reverse cumulative sums."""
    returns = []
    for reward, k, mask in zip(rewards, kl, loss_masks):
        mask = mask.float()
        token_rewards = -kl_coef * k.float() * mask
        loss_positions = mask.nonzero()
        if len(loss_positions):
            token_rewards[loss_positions[-1, 0]] += float(reward)
        ret, running = torch.zeros_like(token_rewards), 0.0
        for t in range(len(token_rewards) - 1, -1, -1):
            running = token_rewards[t] + gamma * running
            ret[t] = running
        returns.append(ret)
    return returns


def get_reinforce_plus_plus_baseline_advantages(
    rewards: Sequence[float], kl: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor], kl_coef: float
) -> list[torch.Tensor]:
    """REINFORCE++-baseline: the (already baseline-subtracted) reward minus kl_coef*kl per token."""
    return [(float(r) - kl_coef * k.float()) * m.float() for r, k, m in zip(rewards, kl, loss_masks)]


def reinforce_plus_plus_advantages(inputs: AdvantageInputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The discounted (--gamma) KL-shaped returns are the advantages before whitening."""
    returns = get_reinforce_plus_plus_returns(inputs.rewards, inputs.kl, inputs.loss_masks, inputs.kl_coef,
                                              inputs.args.gamma)
    return returns, returns


def reinforce_plus_plus_baseline_advantages(inputs: AdvantageInputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The group-centred reward minus the KL term on each token is the advantage before whitening."""
    returns = get_reinforce_plus_plus_baseline_advantages(inputs.rewards, inputs.kl, inputs.loss_masks,
                                                          inputs.kl_coef)
    return returns, returns


REINFORCE_PLUS_PLUS = register(Estimator(
    name="reinforce_plus_plus", advantages=reinforce_plus_plus_advantages, policy_loss=ppo_clip_loss,
    always_whitened=True, whole_rollout=True))
REINFORCE_PLUS_PLUS_BASELINE = register(Estimator(
    name="reinforce_plus_plus_baseline", advantages=reinforce_plus_plus_baseline_advantages,
    policy_loss=ppo_clip_loss, group_normalised=True, always_whitened=True, whole_rollout=True))
