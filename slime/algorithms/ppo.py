"""PPO: generalised advantage estimation (--gamma, --lambd) over a critic's values, and the critic's clipped
value loss (--value-clip)."""

from __future__ import annotations

from typing import Sequence

import torch

from slime.algorithms.policy_loss import ppo_clip_loss
from slime.algorithms.registry import AdvantageInputs, Estimator, register


def get_advantages_and_returns(
    total_len: int,
    response_len: int,
    values: torch.Tensor,
    rewards: torch.Tensor,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over one response: A_t = sum_l (gamma*lambd)^l delta_{t+l},
    delta_t = r_t + gamma*V_{t+1} - V_t (V past the end is 0); returns = A + V."""
    assert values.numel() == rewards.numel() == response_len <= total_len
    advantages = torch.zeros(response_len, dtype=torch.float32)
    last = 0.0
    for t in range(response_len - 1, -1, -1):
        next_value = values[t + 1] if t + 1 < response_len else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lambd * last
        advantages[t] = last
    return advantages, advantages + values.float()


def get_ppo_token_rewards(rewards: Sequence[float], kl: Sequence[torch.Tensor], kl_coef: float) -> list[torch.Tensor]:
    """PPO's per-token rewards: -kl_coef * kl on every response token, the sample's reward on its last."""
    token_rewards = []
    for reward, k in zip(rewards, kl):
        r = -kl_coef * k.float()
        if len(r):
            r[-1] += float(reward)
        token_rewards.append(r)
    return token_rewards


def get_ppo_advantages_and_returns(
    rewards: Sequence[float],
    kl: Sequence[torch.Tensor],
    values: Sequence[Sequence[float]],
    kl_coef: float,
    gamma: float,
    lambd: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE (--gamma, --lambd) over each response with the critic's values of the rollout."""
    advantages, returns = [], []
    for token_rewards, value in zip(get_ppo_token_rewards(rewards, kl, kl_coef), values):
        value = torch.as_tensor(value, dtype=torch.float32)
        if value.numel() != token_rewards.numel():
            raise ValueError(f"the critic gave {value.numel()} values for a response of {token_rewards.numel()} "
                             "tokens; values are one per response token")
        adv, ret = get_advantages_and_returns(len(token_rewards), len(token_rewards), value, token_rewards,
                                              gamma, lambd)
        advantages.append(adv)
        returns.append(ret)
    return advantages, returns


def ppo_advantages(inputs: AdvantageInputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE over the critic's values of the rollout."""
    if inputs.values is None:
        raise ValueError("--advantage-estimator ppo needs the critic's values ('values') in the rollout data")
    kl = inputs.kl
    if not inputs.kl_coef:  # no KL reward term: the per-token rewards' shape is the masks'. The log-probs' KL would
        kl = [torch.zeros_like(m) for m in inputs.loss_masks]  # be empty for samples of other DP ranks (actor DP > 1)
    return get_ppo_advantages_and_returns(inputs.rewards, kl, inputs.values, inputs.kl_coef, inputs.args.gamma,
                                          inputs.args.lambd)


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    value_clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's clipped value loss per token (upstream's --value-clip).

    max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2): a value may not gain by moving more than
    ``value_clip`` from the one the rollout's advantages were computed with. Returns (losses, clipfrac:
    1.0 where |V - V_old| > c).
    """
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    losses = torch.maximum((values - returns).pow(2), (clipped - returns).pow(2))
    return losses, ((values - old_values).abs() > value_clip).float()


PPO = register(Estimator(name="ppo", advantages=ppo_advantages, policy_loss=ppo_clip_loss,
                         value_loss=compute_value_loss))
