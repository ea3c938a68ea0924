"""The critic's loss on one packed micro-batch: the clipped value loss of upstream's --value-clip.

The value model (value_head.py) gives one value per position; position t values the state before target
token t+1, the alignment the log-probs use, so the rollout's values and returns sit where the packed batch
put them (data.py). Weights are the policy loss's (per-sample mean, or per token with
--calculate-per-token-loss), so the critic's and the actor's steps normalise alike.
"""
from __future__ import annotations

from typing import Any

import torch

from slime.backends.megatron_utils.data import MicroBatchPlan, PackedMicroBatch
from slime.backends.megatron_utils.train_step import StepObjective, compute_log_probs
from slime.config.loss import ValueLossConfig
from slime.config.run_config import run_value_loss

VALUE_METRIC_KEYS = ("value_clipfrac", "value_loss", "values")


def flat_values(output: torch.Tensor, packed: PackedMicroBatch) -> torch.Tensor:
    """[T_local] fp32 values from the value model's output ([1, T, 1] or [T, 1, 1])."""
    flat = output.reshape(-1).float()
    if flat.numel() != packed.labels.numel():
        raise ValueError(f"the value model gave {flat.numel()} values, the packed batch has {packed.labels.numel()} "
                         "positions")
    return flat


def value_weights(packed: PackedMicroBatch, plan: MicroBatchPlan, cfg: ValueLossConfig) -> torch.Tensor:
    if cfg.calculate_per_token_loss:
        return packed.loss_mask / max(1, plan.step_loss_token_total)
    return packed.loss_mask * packed.sample_weight / max(1, plan.step_sample_count)


def value_micro_batch_loss(output: torch.Tensor, packed: PackedMicroBatch, plan: MicroBatchPlan,
                           cfg: ValueLossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's contribution to the critic's step loss, and to each metric (detached sums).

    A padding micro-batch gives an exact 0 that stays connected to the model, so backward runs on every rank.
    """
    if packed.old_values is None or packed.returns is None:
        raise ValueError("the critic trains on the rollout's 'values' and 'returns' (--advantage-estimator ppo)")
    values = flat_values(output, packed)
    weights = value_weights(packed, plan, cfg)
    losses, clipfrac = cfg.value_loss(values, packed.old_values, packed.returns, cfg.value_clip)
    loss = (losses * weights).sum()
    metrics = {"value_loss": loss.detach(), "value_clipfrac": (clipfrac * weights).sum(),
               "values": (values.detach() * weights).sum()}
    return loss, metrics


def value_objective(args: Any) -> StepObjective:
    """The critic's step objective for train_step.train_one_step: the value loss of its run config."""
    cfg = run_value_loss(args)
    return StepObjective(keys=tuple(sorted(("loss", *VALUE_METRIC_KEYS))),
                         micro_batch_loss=lambda output, batch, plan: _with_loss_key(
                             *value_micro_batch_loss(output, batch, plan, cfg)))


def _with_loss_key(loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    # the step reports (and decides the optimizer's skip on) the reduced "loss"
    return loss, metrics | {"loss": metrics["value_loss"]}


def compute_values(model_chunks: Any, data: Any, plans: Any, args: Any, **hooks: Any) -> list[list[float]]:
    """The critic's values of every response token of the plans' samples (forward only; samples outside
    this DP rank's plans get []), gathered over CP as the log-probs are."""
    return compute_log_probs(model_chunks, data, plans, args, scores=flat_values, **hooks)
