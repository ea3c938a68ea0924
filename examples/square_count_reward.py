"""Reward of the square-counting image task (slime/tools/square_images.py), loaded with
`--custom-rm-path examples.square_count_reward.reward`.

The label is the number of red squares in the picture (one digit). The response's first character earns the
counting demo's graded credit (examples/counting_reward.py): 1 for the right count, 2/3 and 1/3 for a count one
or two off, 0 otherwise, so a random policy's group already has spread for GRPO to learn from.
"""
from __future__ import annotations

from examples.counting_reward import digit_credit


def square_count_reward(response: str, label: str) -> float:
    if not (len(label) == 1 and label.isdigit()):
        raise ValueError(f"the square-counting task's label is one digit, got {label!r}")
    answer = response.strip()[:1]
    return digit_credit(answer, label)


async def reward(args, sample, **kwargs) -> float:
    return square_count_reward(sample.response, str(sample.label))
