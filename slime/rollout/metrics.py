"""Rollout and eval metrics: response lengths, rewards, pass@k, truncation and abort rates.

A sample counts as correct for pass@k when its scalar reward is > 0 (1/0 and +1/-1 graders).
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

from slime.utils.types import Sample


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt: 1 - C(n-c, k) / C(n, k)."""
    if k > num_samples:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def _powers_of_two_up_to(n: int) -> list[int]:
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def pass_at_k_metrics(rewards: Sequence[float], groups: Sequence[int], prefix: str) -> dict[str, float]:
    """Mean pass@k over prompts, k = 1, 2, 4, ... up to the smallest group size."""
    correct: dict[int, list[bool]] = defaultdict(list)
    for reward, group in zip(rewards, groups, strict=True):
        correct[group].append(reward > 0)
    if not correct:
        return {}
    smallest = min(len(c) for c in correct.values())
    return {
        f"{prefix}pass@{k}": sum(pass_at_k(len(c), sum(c), k) for c in correct.values()) / len(correct)
        for k in _powers_of_two_up_to(smallest)
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _group_of(samples: Sequence[Sample]) -> list[int]:
    return [s.group_index if s.group_index is not None else pos for pos, s in enumerate(samples)]


def _summary(samples: Sequence[Sample], rewards: Sequence[float], prefix: str) -> dict[str, float]:
    lengths = [s.response_length for s in samples]
    metrics = {
        f"{prefix}response_len/mean": _mean(lengths),
        f"{prefix}response_len/max": float(max(lengths, default=0)),
        f"{prefix}response_len/min": float(min(lengths, default=0)),
        f"{prefix}truncated_ratio": _mean([s.status == Sample.Status.TRUNCATED for s in samples]),
        f"{prefix}aborted_ratio": _mean([s.status == Sample.Status.ABORTED for s in samples]),
    }
    metrics.update(pass_at_k_metrics(rewards, _group_of(samples), prefix))
    return metrics


def zero_std_group_ratio(rewards: Sequence[float], groups: Sequence[int]) -> float:
    """Share of groups whose rewards are all equal (they give GRPO no signal)."""
    members: dict[int, set[float]] = defaultdict(set)
    for reward, group in zip(rewards, groups, strict=True):
        members[group].add(float(reward))
    return _mean([len(values) == 1 for values in members.values()])


def compute_rollout_metrics(args, samples: Sequence[Sample]) -> dict[str, float]:
    """Metrics of one training rollout (flat list of rewarded samples), keys under `rollout/`."""
    rewards = [float(s.get_reward_value(args)) for s in samples]
    metrics = _summary(samples, rewards, "rollout/")
    metrics["rollout/raw_reward"] = _mean(rewards)
    metrics["rollout/zero_std_group_ratio"] = zero_std_group_ratio(rewards, _group_of(samples))
    metrics["rollout/num_samples"] = float(len(samples))
    return dict(sorted(metrics.items()))


def compute_eval_metrics(name: str, samples: Sequence[Sample], rewards: Sequence[float]) -> dict[str, float]:
    """Metrics of one eval dataset: `eval/<name>` is the mean reward, details under `eval/<name>/`."""
    metrics = _summary(samples, rewards, f"eval/{name}/")
    metrics[f"eval/{name}"] = _mean(rewards)
    return dict(sorted(metrics.items()))
