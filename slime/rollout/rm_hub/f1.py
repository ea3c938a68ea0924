"""`--rm-type f1`: token-level F1 between response and label (SQuAD-style normalisation)."""
from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace."""
    text = str(text).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1_score(prediction: str, ground_truth) -> tuple[float, float, float]:
    """(f1, precision, recall); with a list of labels, the best F1 among them."""
    if isinstance(ground_truth, (list, tuple)):
        scores = [f1_score(prediction, truth) for truth in ground_truth] or [(0.0, 0.0, 0.0)]
        return max(scores)
    pred_tokens = normalize_answer(prediction).split()
    truth_tokens = normalize_answer(ground_truth).split()
    common = sum((Counter(pred_tokens) & Counter(truth_tokens)).values())
    if common == 0:
        return 0.0, 0.0, 0.0
    precision = common / len(pred_tokens)
    recall = common / len(truth_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall
