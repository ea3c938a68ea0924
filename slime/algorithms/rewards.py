"""Reward normalisation within a prompt's group, for the estimators whose record is `group_normalised`.
Plain Python floats: the rollout manager runs it on every rollout without torch."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

STD_EPS = 1e-6


def _sample_std(values: list[float], mean: float) -> float:
    # unbiased (n-1), the convention of upstream's torch.std; one sample has no spread
    if len(values) < 2:
        return 0.0
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def group_normalize(rewards: Sequence[float], groups: Sequence[int], *, divide_by_std: bool) -> list[float]:
    """reward - group mean (and / (group std + 1e-6) when divide_by_std), per group id."""
    members: dict[int, list[float]] = defaultdict(list)
    for reward, group in zip(rewards, groups, strict=True):
        members[group].append(float(reward))
    stats = {}
    for group, values in members.items():
        mean = sum(values) / len(values)
        stats[group] = (mean, _sample_std(values, mean) + STD_EPS if divide_by_std else 1.0)
    return [(float(r) - stats[g][0]) / stats[g][1] for r, g in zip(rewards, groups)]
