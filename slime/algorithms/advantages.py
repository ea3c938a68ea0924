"""The actor's advantages and returns of a rollout: the estimator's own (its record's `advantages`) between the
steps every estimator shares: the KL reward shaping before, the distillation penalty and whitening after.

Rewards are expected post-processed (group-normalised where the record says so) by the rollout side. The
functions are pure: the data every rank shares gives the same result on each (no collective).
"""

from __future__ import annotations

from typing import Any

import torch

from slime.algorithms.kl import compute_approx_kl
from slime.algorithms.registry import AdvantageInputs, estimator
from slime.utils.rollout_batch import RolloutBatch

OPD_KL_KEY = "opd_reverse_kl"
"""Per-token reverse KL of each sample in the rollout data, and the train metric (its loss-token mean)."""


def compute_advantages_and_returns(args: Any, data: RolloutBatch) -> None:
    """Fill data['advantages'] and data['returns'] (per response token) in place.

    KL shaping (reinforce++ families) uses data['log_probs'] (data['rollout_log_probs'] with
    --use-rollout-logprobs) / data['ref_log_probs'] when both are present, with --kl-coef.
    """
    record = estimator(args.advantage_estimator)
    masks = [torch.tensor(m, dtype=torch.float32) for m in data["loss_masks"]]
    kl = _shaping_kl(args, data, masks)
    inputs = AdvantageInputs(rewards=data["rewards"], kl=kl, loss_masks=masks, values=data.get("values"),
                             kl_coef=args.kl_coef, args=args)
    advantages, returns = record.advantages(inputs)
    # --use-opd: the distillation penalty joins the estimator's advantages before any whitening (upstream's order)
    advantages = opd_penalised(args, data, advantages)
    if record.always_whitened or args.normalize_advantages:
        advantages = _whiten(advantages, masks)
    data["advantages"] = [a.tolist() for a in advantages]
    data["returns"] = [r.tolist() for r in returns]


def _shaping_kl(args: Any, data: RolloutBatch, masks: list[torch.Tensor]) -> list[torch.Tensor]:
    # The old policy's log-probs: the engines' with --use-rollout-logprobs (as upstream), else the trainer's.
    policy = data.get("rollout_log_probs" if args.use_rollout_logprobs else "log_probs")
    if policy is None or data.get("ref_log_probs") is None:
        return [torch.zeros_like(m) for m in masks]
    kl_type = args.kl_loss_type
    return [
        compute_approx_kl(torch.tensor(lp), torch.tensor(ref), kl_type)
        for lp, ref in zip(policy, data["ref_log_probs"])
    ]


def _whiten(values: list[torch.Tensor], masks: list[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """Normalise over all loss tokens of the rollout (data every rank shares: no collective)."""
    flat, flat_mask = torch.cat(values), torch.cat(masks)
    count = flat_mask.sum().clamp(min=1.0)
    mean = (flat * flat_mask).sum() / count
    var = ((flat - mean).pow(2) * flat_mask).sum() / count
    return [(v - mean) * torch.rsqrt(var + eps) * m for v, m in zip(values, masks)]


def opd_penalised(args: Any, data: RolloutBatch, advantages: list[torch.Tensor]) -> list[torch.Tensor]:
    """`advantages - opd_kl_coef * (student - teacher)` per sample; stores the reverse KL as data[OPD_KL_KEY].

    A sample without student log-probs here (an empty list: another DP rank computed them) keeps its
    advantages; this rank does not train on it.
    """
    if not args.use_opd:
        return advantages
    student = data.get("rollout_log_probs" if args.use_rollout_logprobs else "log_probs")
    teacher = data.get("teacher_log_probs")
    if teacher is None:
        source = ("--opd-teacher-load (the trainer's teacher)" if args.opd_type == "megatron" else
                  "the teacher engine: --custom-rm-path slime.rollout.on_policy_distillation.reward_func with "
                  "--rm-url at the teacher's /generate")
        raise ValueError(f"--use-opd --opd-type {args.opd_type}: the rollout data has no teacher_log_probs; they "
                         f"come from {source}")
    if student is None:
        raise ValueError("--use-opd needs the student's log-probs (the trainer's old-policy pass)")
    coef = float(args.opd_kl_coef)
    penalised, kls = [], []
    for index, (adv, own, theirs) in enumerate(zip(advantages, student, teacher, strict=True)):
        if len(own) == 0:
            penalised.append(adv)
            kls.append([])
            continue
        if len(own) != len(theirs):
            raise ValueError(f"sample {index}: {len(theirs)} teacher log-probs for {len(own)} response tokens")
        kl = torch.tensor(own, dtype=torch.float32) - torch.tensor(theirs, dtype=torch.float32)
        penalised.append(adv - coef * kl)
        kls.append(kl.tolist())
    data[OPD_KL_KEY] = kls
    return penalised
