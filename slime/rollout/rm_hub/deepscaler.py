"""`--rm-type deepscaler`: reasoning-format reward. The boxed answer is read from the response's tail:
after the last `</think>`, or (responses of base-model prompt formats) after `###Response`."""
from __future__ import annotations

from .math_utils import boxed_content, grade_answer

THINK_END = "</think>"
RESPONSE_MARKER = "###Response"


def solution_tail(response: str) -> str | None:
    """The part of the response that holds the final answer, or None when neither marker is present."""
    if THINK_END in response:
        return response.rsplit(THINK_END, 1)[1]
    if RESPONSE_MARKER in response:
        return response.split(RESPONSE_MARKER, 1)[1]
    return None


def get_deepscaler_rule_based_reward(response: str, label) -> int:
    """1 when the boxed answer of the solution tail equals the label (or any label in a list), else 0."""
    solution = solution_tail(response)
    if solution is None:
        return 0
    answer = boxed_content(solution)
    if answer is None:
        return 0
    labels = label if isinstance(label, (list, tuple)) else [label]
    for truth in labels:
        truth_text = str(truth)
        # labels are sometimes written boxed themselves
        truth_answer = boxed_content(truth_text) if "\\boxed" in truth_text else truth_text
        if grade_answer(answer, truth_answer):
            return 1
    return 0
