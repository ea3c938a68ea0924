"""Upstream slime's import path of the PPO-family maths: ``from slime.utils.ppo_utils import
compute_policy_loss`` and the other names below keep working for plug-ins. The maths lives in
``slime.algorithms`` (one module per estimator, the shared steps beside them); this module only re-exports it.
"""

from __future__ import annotations

from slime.algorithms.advantages import OPD_KL_KEY, compute_advantages_and_returns, opd_penalised
from slime.algorithms.cispo import compute_cispo_loss
from slime.algorithms.grpo import get_grpo_returns
from slime.algorithms.kl import compute_approx_kl
from slime.algorithms.log_probs import compute_entropy_from_logits, compute_log_probs
from slime.algorithms.policy_loss import compute_policy_loss, compute_tis_weights
from slime.algorithms.ppo import (
    compute_value_loss,
    get_advantages_and_returns,
    get_ppo_advantages_and_returns,
    get_ppo_token_rewards,
)
from slime.algorithms.reinforce_plus_plus import (
    get_reinforce_plus_plus_baseline_advantages,
    get_reinforce_plus_plus_returns,
)

__all__ = [
    "OPD_KL_KEY",
    "compute_advantages_and_returns",
    "compute_approx_kl",
    "compute_cispo_loss",
    "compute_entropy_from_logits",
    "compute_log_probs",
    "compute_policy_loss",
    "compute_tis_weights",
    "compute_value_loss",
    "get_advantages_and_returns",
    "get_grpo_returns",
    "get_ppo_advantages_and_returns",
    "get_ppo_token_rewards",
    "get_reinforce_plus_plus_baseline_advantages",
    "get_reinforce_plus_plus_returns",
    "opd_penalised",
]
