"""`--rm-type deepscaler`: reasoning-format reward. The answer must follow `</think>` and be boxed."""
from __future__ import annotations

from .math_utils import extract_answer, grade_answer

THINK_END = "</think>"


def get_deepscaler_rule_based_reward(response: str, label) -> int:
    """1 when the boxed answer after `</think>` equals the label (or any label in a list), else 0."""
    if THINK_END not in response:
        return 0
    solution = response.split(THINK_END, 1)[1]
    answer = extract_answer(solution)
    if answer is None:
        return 0
    labels = label if isinstance(label, (list, tuple)) else [label]
    for truth in labels:
        truth_text = str(truth)
        # labels are sometimes written boxed themselves
        truth_answer = extract_answer(truth_text) if "\\boxed" in truth_text else truth_text
        if grade_answer(answer, truth_answer):
            return 1
    return 0
