"""Reward of the counting task (the learnable CPU demo), loaded with
`--custom-rm-path examples.counting_reward.reward`.

The prompt is a run of consecutive digits modulo 10 ("789"), the label the digits that continue
it ("012"). Each label position earns partial credit for the response character at the same
position: 1 for the right digit, 2/3 and 1/3 for a digit one or two steps off (cyclically: 9 is
next to 0), 0 for anything else. The reward is the mean over the label's positions, in [0, 1].
Graded credit matters here: a random policy already earns some reward with spread inside each
group, which gives GRPO a signal from the first rollout (an exact-match reward would not).
"""
from __future__ import annotations

CREDIT_RANGE = 3  # digits this many steps off (or more) earn nothing


def digit_credit(got: str, want: str) -> float:
    if not (got.isdigit() and want.isdigit()):
        return 0.0
    steps = abs(int(got) - int(want)) % 10
    return max(0.0, 1.0 - min(steps, 10 - steps) / CREDIT_RANGE)


def counting_reward(response: str, label: str) -> float:
    """Mean credit over the label's positions (a missing character earns 0)."""
    if not label:
        raise ValueError("the counting task needs a non-empty label")
    return sum(digit_credit(got, want) for got, want in zip(response, label)) / len(label)


async def reward(args, sample, **kwargs) -> float:
    return counting_reward(sample.response, str(sample.label))
