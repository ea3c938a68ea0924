"""KL estimators between two policies' per-token log-probs: the KL loss term and the KL reward shaping."""

from __future__ import annotations

import torch


def compute_approx_kl(log_probs: torch.Tensor, log_probs_base: torch.Tensor, kl_loss_type: str) -> torch.Tensor:
    """Per-token KL(pi || pi_base) estimate (Schulman's k1, k2, k3).

    k1: log r; k2: (log r)^2 / 2; k3 / low_var_kl: r' - 1 - log r' with r' = pi_base/pi,
    an unbiased, non-negative estimator; low_var_kl is additionally clamped to [-10, 10].
    """
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_loss_type == "k1":
        return log_ratio
    if kl_loss_type == "k2":
        return log_ratio.pow(2) / 2.0
    if kl_loss_type in ("k3", "low_var_kl"):
        kl = torch.expm1(-log_ratio) + log_ratio
        return kl.clamp(-10.0, 10.0) if kl_loss_type == "low_var_kl" else kl
    raise ValueError(f"unknown kl_loss_type {kl_loss_type!r} (k1, k2, k3, low_var_kl)")
