"""Built-in dynamic-sampling filters (DAPO): keep only groups whose rewards differ."""
from __future__ import annotations

import statistics

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.types import Sample

__all__ = ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]

MIN_STD = 1e-6


def _first(item: Sample | list[Sample]) -> Sample:
    # a multi-turn generate function may return several samples for one prompt; they share its reward
    return item[0] if isinstance(item, list) else item


def check_reward_nonzero_std(args, samples: list[Sample | list[Sample]], **kwargs) -> DynamicFilterOutput:
    """Drop a group whose rewards are all equal: its GRPO advantages are zero, it would train on nothing."""
    rewards = [float(_first(s).get_reward_value(args)) for s in samples]
    keep = len(rewards) > 1 and statistics.stdev(rewards) > MIN_STD
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args, samples: list[Sample | list[Sample]], **kwargs) -> DynamicFilterOutput:
    """As check_reward_nonzero_std, but keeps equal-reward groups rather than start another sampling round."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output
