"""`--rm-type dapo`: DAPO-style reward, answer on an `Answer: ...` line, score +1 / -1.

Returns a dict (score, acc, pred) like upstream; train on it with `--reward-key score`.
"""
from __future__ import annotations

import re

from .math_utils import boxed_content, grade_answer, normalize_answer

# only the tail is searched: a long chain of thought may mention "Answer:" earlier
_TAIL_CHARS = 300
_BOX_TAIL_CHARS = 100
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def extract_dapo_answer(solution: str, strict_box_verify: bool = False) -> str | None:
    """The text after the last `Answer:` in the tail (or the boxed answer in strict mode)."""
    if strict_box_verify:
        return boxed_content(solution[-_BOX_TAIL_CHARS:])
    matches = _ANSWER_LINE.findall(solution[-_TAIL_CHARS:])
    if not matches:
        return None
    answer = matches[-1].strip()
    boxed = boxed_content(answer)
    return boxed if boxed is not None else answer


def compute_score(solution_str: str, ground_truth, strict_box_verify: bool = False) -> dict:
    """{"score": 1.0 | -1.0, "acc": bool, "pred": normalised prediction}."""
    pred = extract_dapo_answer(solution_str or "", strict_box_verify)
    correct = pred is not None and grade_answer(pred, ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": normalize_answer(pred) if pred else "[INVALID]"}
