"""On-policy distillation (`--use-opd`): the student trains on its own rollouts towards a teacher's log-probs.

Per response token the reverse KL estimate `log pi_student - log pi_teacher` (student: the old-policy
log-probs the trainer computed, or the engines' with --use-rollout-logprobs) is subtracted from the
advantage, times `--opd-kl-coef`: on top of whatever the advantage estimator gave (upstream's rule; with
zero task rewards it is pure distillation). Where the teacher's log-probs come from:
  --opd-type sglang    a teacher engine scores each rollout sample (slime.rollout.on_policy_distillation as
                       --custom-rm-path / --custom-reward-post-process-path, the engine at --rm-url)
  --opd-type megatron  the trainer holds a teacher copy of the model (--opd-teacher-load, same architecture)
                       and scores the rollout in the log-prob phase, next to the reference model
Both score at the rollout temperature, as the student's log-probs are. The penalty itself is advantage maths:
`slime.algorithms.advantages.opd_penalised`.
"""
from __future__ import annotations

from typing import Any


def megatron_teacher(args: Any) -> tuple[str, int | None] | None:
    """(checkpoint, iteration) of the teacher the trainer loads, or None (no OPD, or a teacher engine)."""
    if not args.use_opd or args.opd_type != "megatron":
        return None
    return args.opd_teacher_load, args.opd_teacher_ckpt_step
