"""The RL algorithm: one `Estimator` record per --advantage-estimator (registry.py) and the maths it uses.

  registry.py             the record (group/std normalisation, whitening, whole-rollout, ratio mode, its
                          advantages, policy-loss and value-loss terms, the flags it refuses) and the look-up
  grpo.py, cispo.py,      one module per estimator (or family of variants): its own maths and its record
  reinforce_plus_plus.py,
  ppo.py
  advantages.py           the steps every estimator shares: KL reward shaping, distillation penalty, whitening
  policy_loss.py          PPO's clipped surrogate, GSPO's per-sample ratio, truncated importance sampling
  kl.py, log_probs.py     KL estimators; log-probs and entropy over a vocab-parallel group
  rewards.py              reward normalisation within a prompt's group

`slime.utils.ppo_utils` re-exports the maths at upstream's import path. This package imports torch and
`slime.utils` alone; its namespace holds the registry only, so reading the flags' choices imports no torch.
"""

from __future__ import annotations

from slime.algorithms.registry import (
    AdvantageInputs,
    Estimator,
    PolicyLossInputs,
    estimator,
    estimator_names,
    register,
)

__all__ = ["AdvantageInputs", "Estimator", "PolicyLossInputs", "estimator", "estimator_names", "register"]
