"""Per-token RL losses of one packed micro-batch, normalised by the step's global denominator.

Normalisation (the choice that makes the loss layout-invariant):
each token's loss is weighted so that the step loss is the plain SUM of every rank's
micro-batch losses over DP x CP ranks and micro-batches:
  per-token  (--calculate-per-token-loss): w_t = mask_t / step_loss_token_total
  per-sample (default, upstream's mean):   w_t = mask_t / n_i / step_sample_count
with n_i the loss tokens of token t's whole sample (not the CP-local part). Both
denominators come from the plan, i.e. from data all ranks share, so no micro-batch,
CP slice or DP partition changes them. Undoing megatron's own loss/grad averaging is
train_step.py's job (see ``megatron_loss_scale`` there).

Train/rollout agreement: ``train_rollout_logprob_abs_diff`` is, on every step, the mean over
the step's loss tokens of |engine log-prob - trainer old-policy log-prob| of each sampled token
(whatever the loss normalisation). Both sides mean log softmax(logits / rollout temperature)
before top-k/top-p filtering (what SGLang returns; the embedded engine's sampling.py matches
it). Right after a weight sync it is numerical noise (~1e-7 in fp32); a push that went wrong
shows up as a diff orders of magnitude larger.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from slime.backends.megatron_utils import logprob_head, loss_hooks, mtp_loss
from slime.backends.megatron_utils.data import MicroBatchPlan, PackedMicroBatch
from slime.algorithms import PolicyLossInputs
from slime.algorithms.advantages import OPD_KL_KEY
from slime.algorithms.kl import compute_approx_kl
from slime.algorithms.log_probs import compute_entropy_from_logits, compute_log_probs
from slime.algorithms.policy_loss import compute_tis_weights
from slime.config.loss import LossConfig
from slime.models import fused_kernels


LOGPROB_DIFF_KEY = "train_rollout_logprob_abs_diff"
# Averaged over loss tokens whatever --calculate-per-token-loss says (the definition).
TOKEN_MEAN_METRICS = (LOGPROB_DIFF_KEY,)


def metric_keys(cfg: LossConfig) -> tuple[str, ...]:
    """The step's metric keys fixed by the flags (equal on every rank); plug-ins may add their own.

    The log-prob diff is always reported; it is NaN when the rollout carries no engine log-probs
    (a custom generate function that returns none), so the key set never depends on data.
    """
    mtp = (mtp_loss.MTP_LOSS_KEY,) if cfg.mtp_depths else ()
    if cfg.loss_type in ("custom_loss", "sft_loss"):
        return tuple(sorted(("loss", LOGPROB_DIFF_KEY, *mtp)))
    keys = ["loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss", LOGPROB_DIFF_KEY, *mtp]
    if cfg.use_kl_loss:
        keys.append("kl_loss")
    if cfg.use_opd:
        keys.append(OPD_KL_KEY)
    if cfg.mismatch_terms:
        keys.append("ois")
        if cfg.custom_tis_function_path is None:  # a TIS plug-in reports its own statistics
            keys += ["tis", "tis_clipfrac", "tis_abs"]
    return tuple(sorted(keys))


def trainer_computes_old_log_probs(cfg: LossConfig) -> bool:
    """Upstream's rule: --use-rollout-logprobs skips the trainer's old-policy forward, unless
    --get-mismatch-metrics needs it to compare with."""
    return not cfg.use_rollout_logprobs or cfg.get_mismatch_metrics


def flat_logits(logits: torch.Tensor, packed: PackedMicroBatch) -> torch.Tensor:
    """[T_local, V/tp] view of the model output ([1,T,V/tp] or [T,1,V/tp]), checked against the batch."""
    flat = logits.reshape(-1, logits.size(-1))
    if flat.size(0) != packed.labels.numel():
        raise ValueError(f"logits cover {flat.size(0)} positions, the packed batch {packed.labels.numel()}")
    return flat


def scaled_logits(logits: torch.Tensor, packed: PackedMicroBatch, cfg: LossConfig) -> torch.Tensor:
    """[T_local, V/tp] fp32 logits / temperature from the model output ([1,T,V/tp] or [T,1,V/tp])."""
    return flat_logits(logits, packed).float() / cfg.temperature


def _fused_head(logits: torch.Tensor, packed: PackedMicroBatch, cfg: LossConfig,
                tp_group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return logprob_head.log_probs_and_entropy(flat_logits(logits, packed), packed.labels, cfg.temperature, tp_group)


def target_log_probs(logits: torch.Tensor, packed: PackedMicroBatch, cfg: LossConfig, tp_group: Any) -> torch.Tensor:
    """log pi(target token) per local position [T_local] (all-reduces over TP)."""
    if fused_kernels.active() == "compile":
        return _fused_head(logits, packed, cfg, tp_group)[0]
    return compute_log_probs(scaled_logits(logits, packed, cfg), packed.labels, tp_group)


def log_probs_and_entropy(logits: torch.Tensor, packed: PackedMicroBatch, cfg: LossConfig,
                          tp_group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(target_log_probs, token_entropy): with --fused-kernels compile both from one fused head."""
    if fused_kernels.active() != "compile":
        return target_log_probs(logits, packed, cfg, tp_group), token_entropy(logits, packed, cfg, tp_group)
    log_probs, entropy = _fused_head(logits, packed, cfg, tp_group)
    return log_probs, entropy if cfg.entropy_coef != 0.0 else entropy.detach()


# The entropy metric (no gradient) runs over chunks of this many logits: at once, its fp32
# intermediates would hold four copies of the [tokens, vocab] logits (~70 GiB at 32k tokens of
# Qwen3's 152k vocabulary), more than the rest of the step's loss.
ENTROPY_CHUNK_ELEMENTS = 2**29


def token_entropy(logits: torch.Tensor, packed: PackedMicroBatch, cfg: LossConfig, tp_group: Any) -> torch.Tensor:
    """Entropy per local position; without gradient when --entropy-coef is 0 (metric only)."""
    if cfg.entropy_coef != 0.0:
        return compute_entropy_from_logits(scaled_logits(logits, packed, cfg), tp_group)
    flat = flat_logits(logits.detach(), packed)
    rows = max(1, ENTROPY_CHUNK_ELEMENTS // flat.size(-1))  # equal on the TP ranks: same tokens, same shard
    with torch.no_grad():
        return torch.cat([compute_entropy_from_logits(chunk.float() / cfg.temperature, tp_group)
                          for chunk in flat.split(rows)])


def token_weights(packed: PackedMicroBatch, plan: MicroBatchPlan, cfg: LossConfig,
                  loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """w_t (see module docstring); zero on prompt, padding and padding micro-batches. ``loss_mask`` replaces the
    batch's own (the MTP depths' shifted masks: the denominators are equal along a sequence)."""
    mask = packed.loss_mask if loss_mask is None else loss_mask
    if cfg.calculate_per_token_loss:
        return mask / max(1, plan.step_loss_token_total)
    return mask * packed.sample_weight / max(1, plan.step_sample_count)


def _rollout_log_probs(packed: PackedMicroBatch, needed_by: str) -> torch.Tensor:
    if packed.rollout_log_probs is None:
        raise ValueError(f"{needed_by} needs the engines' log-probs ('rollout_log_probs') in the rollout data; "
                         "a custom generate function must return them")
    return packed.rollout_log_probs


def trainer_old_log_probs(log_probs: torch.Tensor, packed: PackedMicroBatch) -> torch.Tensor:
    """The trainer's old-policy log-probs; without that pass (--use-rollout-logprobs alone) this step's own,
    detached: equal to the old policy on a rollout's first step, as upstream uses them."""
    return packed.old_log_probs if packed.old_log_probs is not None else log_probs.detach()


def old_policy_log_probs(log_probs: torch.Tensor, packed: PackedMicroBatch, cfg: LossConfig) -> torch.Tensor:
    """The PPO ratio's denominator: the engines' log-probs with --use-rollout-logprobs, else the trainer's."""
    if cfg.use_rollout_logprobs:
        return _rollout_log_probs(packed, "--use-rollout-logprobs")
    return trainer_old_log_probs(log_probs, packed)


def rollout_logprob_abs_diff(log_probs: torch.Tensor, packed: PackedMicroBatch) -> torch.Tensor:
    """|trainer - engine| log-prob per loss token (NaN everywhere when the engines gave none)."""
    if packed.rollout_log_probs is None:
        return torch.full_like(log_probs, math.nan).detach()
    return (trainer_old_log_probs(log_probs, packed) - packed.rollout_log_probs).abs() * packed.loss_mask


def policy_token_terms(log_probs: torch.Tensor, entropy: torch.Tensor, packed: PackedMicroBatch,
                       cfg: LossConfig, *, plugin_args: Any) -> dict[str, torch.Tensor]:
    """Per-token loss terms; ``loss`` is what is minimised, the rest are metrics. ``plugin_args``: the run's flags,
    which a TIS plug-in receives (upstream's signature).

    ``pg_loss_mask`` (custom TIS/RS only) multiplies the weights of the policy-gradient term.
    """
    if packed.advantages is None:
        raise ValueError("rollout data has no 'advantages'; compute them before training")
    mask = packed.loss_mask
    old = old_policy_log_probs(log_probs, packed, cfg)
    # Masked positions get log-ratio 0 so exp() cannot overflow on prompt tokens.
    ppo_kl = (old - log_probs) * mask
    ratio_kl = loss_hooks.sequence_mean_log_ratio(ppo_kl, packed) if cfg.ratio_mode == "sequence" else ppo_kl
    pg_loss, clipfrac = cfg.policy_loss(PolicyLossInputs(
        log_ratio=ratio_kl, log_probs=log_probs, loss_mask=mask, advantages=packed.advantages, eps_clip=cfg.eps_clip,
        eps_clip_high=cfg.eps_clip_high, eps_clip_c=cfg.eps_clip_c))
    terms = {"ppo_kl": ppo_kl, "pg_clipfrac": clipfrac, "entropy_loss": entropy,
             LOGPROB_DIFF_KEY: rollout_logprob_abs_diff(log_probs, packed)}
    if cfg.use_opd:
        if packed.opd_reverse_kl is None:
            raise ValueError("--use-opd: the rollout data has no opd_reverse_kl (computed with the advantages)")
        terms[OPD_KL_KEY] = packed.opd_reverse_kl * mask
    if cfg.mismatch_terms:
        flag = "--use-tis" if cfg.use_tis else "--get-mismatch-metrics"
        rollout = _rollout_log_probs(packed, flag) * mask
        terms["ois"] = torch.exp(-ppo_kl).detach()
        if cfg.custom_tis_function_path:  # upstream's TIS/RS plug-in replaces the vanilla weights
            pg_loss, pg_mask, plugin_metrics = loss_hooks.custom_tis(
                cfg.custom_tis_function_path, plugin_args, pg_loss, trainer_old_log_probs(log_probs, packed), packed,
                loss_hooks.ResponseView.of(packed))
            terms |= plugin_metrics | {"pg_loss_mask": pg_mask}
        else:
            # TIS corrects the trainer's old policy towards the engines' (--use-rollout-logprobs is refused with it).
            train_old = trainer_old_log_probs(log_probs, packed) * mask
            tis, tis_clipfrac = compute_tis_weights(train_old, rollout, cfg.tis_clip, cfg.tis_clip_low)
            ratio = torch.exp(train_old - rollout)
            if cfg.use_tis:
                pg_loss = pg_loss * tis
            terms |= {"tis": ratio, "tis_clipfrac": tis_clipfrac, "tis_abs": (ratio - 1).abs()}
    loss = pg_loss - cfg.entropy_coef * entropy
    if cfg.use_kl_loss:
        if packed.ref_log_probs is None:
            raise ValueError("--use-kl-loss needs 'ref_log_probs' in the rollout data")
        kl = compute_approx_kl(log_probs * mask, packed.ref_log_probs * mask, cfg.kl_loss_type)
        loss = loss + cfg.kl_loss_coef * kl
        terms["kl_loss"] = kl
    return terms | {"pg_loss": pg_loss, "loss": loss}


def micro_batch_loss(output: torch.Tensor, packed: PackedMicroBatch, plan: MicroBatchPlan, cfg: LossConfig,
                     tp_group: Any, *, plugin_args: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's contribution to the step loss, and to each metric (detached sums); ``plugin_args``: the run's
    flags, which the loss and TIS plug-ins receive (upstream's signatures).

    Padding micro-batches and empty CP slices give an exact 0 that stays connected to
    the model, so backward runs (and its collectives happen) on every rank. With MTP trained, the output also
    holds the MTP depths' logits (mtp_model.py): their loss (mtp_loss.py) is added, weighted as the main loss is.
    """
    logits, depth_logits = mtp_loss.split_output(output, cfg.mtp_depths)
    loss, metrics = _main_loss(logits, packed, plan, cfg, tp_group, plugin_args)
    if not depth_logits:
        return loss, metrics
    term = mtp_loss.mtp_loss(depth_logits, packed, lambda mask: token_weights(packed, plan, cfg, mask),
                             cfg.mtp_loss_scaling_factor, tp_group)
    # `loss` reports what is minimised (a non-finite MTP loss skips the step too)
    return loss + term, metrics | {mtp_loss.MTP_LOSS_KEY: term.detach(), "loss": metrics["loss"] + term.detach()}


def _main_loss(logits: torch.Tensor, packed: PackedMicroBatch, plan: MicroBatchPlan, cfg: LossConfig,
               tp_group: Any, plugin_args: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_probs, entropy = log_probs_and_entropy(logits, packed, cfg, tp_group)
    weights = token_weights(packed, plan, cfg)
    per_token = packed.loss_mask / max(1, plan.step_loss_token_total)

    def reduced(key: str, value: torch.Tensor) -> torch.Tensor:
        return (value.detach() * (per_token if key in TOKEN_MEAN_METRICS else weights)).sum()

    if cfg.loss_type in ("sft_loss", "custom_loss"):
        diff = {LOGPROB_DIFF_KEY: reduced(LOGPROB_DIFF_KEY, rollout_logprob_abs_diff(log_probs, packed))}
        if cfg.loss_type == "sft_loss":  # negative log-likelihood of the loss tokens
            loss = (-log_probs * weights).sum()
            return loss, diff | {"loss": loss.detach()}
        loss, plugin_metrics = loss_hooks.custom_loss(cfg.custom_loss_function_path, plugin_args, logits, packed,
                                                      loss_hooks.ResponseView.of(packed), log_probs, entropy, weights)
        return loss, plugin_metrics | diff | {"loss": loss.detach()}
    terms = policy_token_terms(log_probs, entropy, packed, cfg, plugin_args=plugin_args)
    pg_mask = terms.pop("pg_loss_mask", None)
    metrics = {key: reduced(key, value) for key, value in terms.items()}
    if pg_mask is None and cfg.custom_pg_loss_reducer_function_path is None:
        return (terms["loss"] * weights).sum(), metrics
    # a plug-in reshapes the policy-gradient term; the other terms keep the default weights
    pg_term = _pg_term(terms["pg_loss"], weights if pg_mask is None else weights * pg_mask, packed, pg_mask, cfg)
    loss = pg_term + ((terms["loss"] - terms["pg_loss"]) * weights).sum()
    return loss, metrics | {"pg_loss": pg_term.detach(), "loss": loss.detach()}


def _pg_term(pg_loss: torch.Tensor, pg_weights: torch.Tensor, packed: PackedMicroBatch,
             pg_mask: torch.Tensor | None, cfg: LossConfig) -> torch.Tensor:
    """The policy-gradient part of the loss: weighted sum, or --custom-pg-loss-reducer-function-path."""
    if cfg.custom_pg_loss_reducer_function_path is None:
        return (pg_loss * pg_weights).sum()
    masked = packed if pg_mask is None else dataclasses.replace(packed, loss_mask=packed.loss_mask * pg_mask)
    reduce = loss_hooks.custom_pg_reducer(cfg.custom_pg_loss_reducer_function_path, masked,
                                          loss_hooks.ResponseView.of(packed), cfg.calculate_per_token_loss)
    return reduce(pg_loss)
