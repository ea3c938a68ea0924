"""Reward post-processing (GRPO group normalisation) and the rollout -> trainer data format.

The trainer receives a dict of equal-length lists, one entry per sample, in rollout order:
  tokens            list[list[int]]   prompt + response token ids
  response_lengths  list[int]
  loss_masks        list[list[int]]   one entry per response token (all 0 for removed samples)
  rewards           list[float]       post-processed (group-normalised for grpo/gspo/cispo/rf++ baseline)
  raw_reward        list[float]       the graders' scalar reward
  truncated         list[int]         1 when the engine stopped on the length limit
  sample_indices    list[int]         Sample.index (global id)
  rollout_log_probs list[list[float]] engine log-probs of response tokens (only when every sample has them)
  teacher_log_probs list[list[float]] a distillation teacher's log-probs of them (likewise)
  rollout_routed_experts list[str]  the engines' routes (base64 int32 [tokens, MoE layers, top-k]; routing replay)
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Sequence

from slime.utils.types import Sample

# the keys every rollout batch has (a custom conversion must return them all)
TRAIN_DATA_KEYS = ("tokens", "response_lengths", "rewards", "raw_reward", "truncated", "sample_indices", "loss_masks")

# estimators whose rewards are centred within each prompt's group
GROUP_NORMALISED_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
# of those, the ones that also divide by the group's std (unless --disable-grpo-std-normalization)
STD_NORMALISED_ESTIMATORS = ("grpo", "gspo", "cispo")
STD_EPS = 1e-6


def flatten_groups(samples: Sequence[Sample] | Sequence[Sequence[Sample]]) -> list[Sample]:
    """Groups (whose entries may be lists: a generate function returning several samples) -> list[Sample]."""
    flat: list[Sample] = []
    for item in samples:
        if isinstance(item, (list, tuple)):
            flat.extend(flatten_groups(item))
        else:
            flat.append(item)
    return flat


def group_ids(samples: list[Sample], n_samples_per_prompt: int) -> list[int]:
    """Each sample's group: its group_index, or consecutive blocks of n when group_index is unset."""
    if all(s.group_index is not None for s in samples):
        return [s.group_index for s in samples]
    if len(samples) % n_samples_per_prompt:
        raise ValueError(f"{len(samples)} samples do not split into groups of {n_samples_per_prompt}")
    return [pos // n_samples_per_prompt for pos in range(len(samples))]


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


def post_process_rewards(args, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """(raw rewards, rewards for training); --custom-reward-post-process-path overrides."""
    hook = args.custom_reward_post_process_path
    if hook:
        from slime.utils.misc import load_function

        return load_function(hook)(args, samples)
    raw = [float(s.get_reward_value(args)) for s in samples]
    estimator = args.advantage_estimator
    if estimator not in GROUP_NORMALISED_ESTIMATORS or not args.rewards_normalization:
        return raw, list(raw)
    divide = estimator in STD_NORMALISED_ESTIMATORS and args.grpo_std_normalization
    groups = group_ids(samples, args.n_samples_per_prompt)
    return raw, group_normalize(raw, groups, divide_by_std=divide)


def _loss_mask(sample: Sample) -> list[int]:
    mask = [1] * sample.response_length if sample.loss_mask is None else list(sample.loss_mask)
    if len(mask) != sample.response_length:
        raise ValueError(f"sample {sample.index}: loss_mask has {len(mask)} entries, response_length is {sample.response_length}")
    return [0] * len(mask) if sample.remove_sample else mask


def _check_sample(sample: Sample) -> None:
    if sample.response_length > len(sample.tokens):
        raise ValueError(f"sample {sample.index}: response_length {sample.response_length} > {len(sample.tokens)} tokens")
    for name in ("rollout_log_probs", "teacher_log_probs"):
        logps = getattr(sample, name)
        if logps is not None and len(logps) != sample.response_length:
            raise ValueError(f"sample {sample.index}: {len(logps)} {name} for {sample.response_length} response tokens")


def samples_to_train_data(args, samples: Sequence[Sample] | Sequence[Sequence[Sample]]) -> dict[str, list[Any]]:
    """The trainer's rollout batch (see module docstring) from rewarded samples."""
    flat = flatten_groups(samples)
    for sample in flat:
        _check_sample(sample)
    raw, rewards = post_process_rewards(args, flat)
    data: dict[str, list[Any]] = {
        "tokens": [list(s.tokens) for s in flat],
        "response_lengths": [s.response_length for s in flat],
        "loss_masks": [_loss_mask(s) for s in flat],
        "rewards": rewards,
        "raw_reward": raw,
        "truncated": [int(s.status == Sample.Status.TRUNCATED) for s in flat],
        "sample_indices": [s.index for s in flat],
    }
    if flat and all(s.rollout_log_probs is not None for s in flat):
        data["rollout_log_probs"] = [list(s.rollout_log_probs) for s in flat]
    if flat and all(s.teacher_log_probs is not None for s in flat):  # --use-opd --opd-type sglang
        data["teacher_log_probs"] = [[float(v) for v in s.teacher_log_probs] for s in flat]
    if flat and all(s.rollout_routed_experts is not None for s in flat):
        data["rollout_routed_experts"] = [s.rollout_routed_experts for s in flat]
    return data
