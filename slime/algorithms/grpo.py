"""GRPO and GSPO: a sample's advantage is its reward, centred (and scaled by the std) within its prompt's group.

GSPO (`--advantage-estimator gspo`) is GRPO with one importance ratio per sample instead of per token.
"""

from __future__ import annotations

from typing import Sequence

import torch

from slime.algorithms.policy_loss import ppo_clip_loss
from slime.algorithms.registry import AdvantageInputs, Estimator, register


def get_grpo_returns(rewards: Sequence[float], kl: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """GRPO: every response token's return is its sample's (group-normalised) reward."""
    return [torch.ones_like(k, dtype=torch.float32) * float(r) for r, k in zip(rewards, kl)]


def grpo_advantages(inputs: AdvantageInputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Advantages and returns are both the sample's reward on each of its tokens."""
    returns = get_grpo_returns(inputs.rewards, inputs.kl)
    return returns, returns


GRPO = register(Estimator(name="grpo", advantages=grpo_advantages, policy_loss=ppo_clip_loss,
                          group_normalised=True, std_normalised=True))
GSPO = register(Estimator(name="gspo", advantages=grpo_advantages, policy_loss=ppo_clip_loss, ratio_mode="sequence",
                          group_normalised=True, std_normalised=True))
