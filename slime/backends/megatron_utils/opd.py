"""On-policy distillation (`--use-opd`): the student trains on its own rollouts towards a teacher's log-probs.

Per response token the reverse KL estimate `log pi_student - log pi_teacher` (student: the old-policy
log-probs the trainer computed, or the engines' with --use-rollout-logprobs) is subtracted from the
advantage, times `--opd-kl-coef`: on top of whatever the advantage estimator gave (upstream's rule; with
zero task rewards it is pure distillation). Where the teacher's log-probs come from:
  --opd-type sglang    a teacher engine scores each rollout sample (slime.rollout.on_policy_distillation as
                       --custom-rm-path / --custom-reward-post-process-path, the engine at --rm-url)
  --opd-type megatron  the trainer holds a teacher copy of the model (--opd-teacher-load, same architecture)
                       and scores the rollout in the log-prob phase, next to the reference model
Both score at the rollout temperature, as the student's log-probs are.
"""
from __future__ import annotations

from typing import Any

import torch

OPD_KL_KEY = "opd_reverse_kl"
"""Per-token reverse KL of each sample in the rollout data, and the train metric (its loss-token mean)."""


def megatron_teacher(args: Any) -> tuple[str, int | None] | None:
    """(checkpoint, iteration) of the teacher the trainer loads, or None (no OPD, or a teacher engine)."""
    if not args.use_opd or args.opd_type != "megatron":
        return None
    return args.opd_teacher_load, args.opd_teacher_ckpt_step


def opd_penalised(args: Any, data: dict[str, Any], advantages: list[torch.Tensor]) -> list[torch.Tensor]:
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
