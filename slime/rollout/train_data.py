"""The rollout -> trainer conversion: rewarded samples -> the rollout batch (slime/utils/rollout_batch.py lists
its keys), with the rewards post-processed as the run's estimator says (group normalisation: its record's
`group_normalised` / `std_normalised`, slime/algorithms).
"""
from __future__ import annotations

from typing import Sequence

from slime.algorithms import estimator
from slime.algorithms.rewards import group_normalize
from slime.utils.rollout_batch import RolloutBatch
from slime.utils.types import Sample


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


def post_process_rewards(args, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """(raw rewards, rewards for training); --custom-reward-post-process-path overrides."""
    hook = args.custom_reward_post_process_path
    if hook:
        from slime.utils.misc import load_function

        return load_function(hook)(args, samples)
    raw = [float(s.get_reward_value(args)) for s in samples]
    record = estimator(args.advantage_estimator)
    if not record.group_normalised or not args.rewards_normalization:
        return raw, list(raw)
    divide = record.std_normalised and args.grpo_std_normalization
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


def samples_to_train_data(args, samples: Sequence[Sample] | Sequence[Sequence[Sample]]) -> RolloutBatch:
    """The trainer's rollout batch from rewarded samples."""
    flat = flatten_groups(samples)
    for sample in flat:
        _check_sample(sample)
    raw, rewards = post_process_rewards(args, flat)
    data: RolloutBatch = {
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
    if any(s.multimodal_train_inputs is not None for s in flat):
        data["multimodal_train_inputs"] = [s.multimodal_train_inputs for s in flat]
    return data
