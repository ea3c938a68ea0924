"""The loss options of the run config: the actor's policy loss (``LossConfig``) and the critic's value loss
(``ValueLossConfig``), derived from the flags once by ``build_run_config`` (run_config.py). The trainer's loss
(slime/backends/megatron_utils/loss.py, value_loss.py) takes them as they are."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime.algorithms import estimator
from slime.algorithms.registry import PolicyLossTerm, RatioMode, ValueLossTerm, deferred


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The policy loss's options (--loss-type and its flags)."""

    calculate_per_token_loss: bool
    """Normalise by the step's loss tokens instead of averaging per-sample means."""
    eps_clip: float
    eps_clip_high: float
    eps_clip_c: float | None
    """Dual-clip bound for negative advantages (None: off)."""
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    entropy_coef: float
    use_tis: bool
    tis_clip: float
    tis_clip_low: float
    temperature: float
    """Logits are divided by the rollout temperature, as the engine sampled with it."""
    policy_loss: PolicyLossTerm
    """The estimator's policy-gradient term per token (PPO's clipped surrogate; CISPO's clipped weight times
    log pi)."""
    use_rollout_logprobs: bool = False
    """The engines' log-probs are the old policy (--use-rollout-logprobs)."""
    get_mismatch_metrics: bool = False
    """Also report the TIS ratio statistics and ois (--get-mismatch-metrics); the loss is unchanged."""
    ratio_mode: RatioMode = "token"
    """The estimator's importance ratio: per token, or per sample (GSPO: the mean token log-ratio, clipped per
    sample)."""
    use_opd: bool = False
    """On-policy distillation: report the rollout's reverse KL to the teacher (opd_reverse_kl)."""
    loss_type: str = "policy_loss"
    custom_loss_function_path: str | None = None
    custom_tis_function_path: str | None = None
    """Replaces the vanilla TIS weights when --use-tis is on."""
    custom_pg_loss_reducer_function_path: str | None = None
    mtp_depths: int = 0
    """Multi-token-prediction layers trained beside the main loss (--enable-mtp-training); 0: none."""
    mtp_loss_scaling_factor: float = 0.2

    @property
    def has_plugin_metrics(self) -> bool:
        """Metric keys chosen by a plug-in: the ranks agree on them before reducing."""
        return self.loss_type == "custom_loss" or (self.mismatch_terms and self.custom_tis_function_path is not None)

    @property
    def mismatch_terms(self) -> bool:
        return self.use_tis or self.get_mismatch_metrics


@dataclass(frozen=True, kw_only=True)
class ValueLossConfig:
    """The critic's loss options (--advantage-estimator ppo)."""

    value_clip: float
    """--value-clip: how far a value may move from the rollout's before its loss stops improving."""
    calculate_per_token_loss: bool
    """Normalise by the step's loss tokens instead of averaging per-sample means (as the actor)."""
    value_loss: ValueLossTerm | None
    """The estimator's value-loss term per token (its record's `value_loss`: PPO's clipped value loss; None for an
    estimator without a critic)."""


def build_loss_config(args: Any) -> LossConfig:
    """The policy loss's options of checked flags."""
    eps_clip = float(args.eps_clip)
    record = estimator(args.advantage_estimator)
    return LossConfig(
        calculate_per_token_loss=bool(args.calculate_per_token_loss),
        eps_clip=eps_clip,
        eps_clip_high=eps_clip if args.eps_clip_high is None else float(args.eps_clip_high),
        eps_clip_c=args.eps_clip_c,
        use_kl_loss=bool(args.use_kl_loss),
        kl_loss_coef=float(args.kl_loss_coef),
        kl_loss_type=args.kl_loss_type,
        entropy_coef=float(args.entropy_coef),
        use_tis=bool(args.use_tis),
        tis_clip=float(args.tis_clip),
        tis_clip_low=float(args.tis_clip_low),
        temperature=float(args.rollout_temperature),
        use_rollout_logprobs=bool(args.use_rollout_logprobs),
        get_mismatch_metrics=bool(args.get_mismatch_metrics),
        ratio_mode=record.ratio_mode,
        policy_loss=deferred(record.policy_loss),  # the actors that compute no loss never import it
        use_opd=bool(args.use_opd),
        loss_type=args.loss_type,
        custom_loss_function_path=args.custom_loss_function_path,
        custom_tis_function_path=args.custom_tis_function_path,
        custom_pg_loss_reducer_function_path=args.custom_pg_loss_reducer_function_path,
        mtp_depths=args.mtp_num_layers if args.enable_mtp_training else 0,
        mtp_loss_scaling_factor=float(args.mtp_loss_scaling_factor),
    )


def build_value_loss_config(args: Any) -> ValueLossConfig:
    """The critic's loss options of checked flags."""
    return ValueLossConfig(value_clip=float(args.value_clip),
                           calculate_per_token_loss=bool(args.calculate_per_token_loss),
                           value_loss=deferred(estimator(args.advantage_estimator).value_loss))
