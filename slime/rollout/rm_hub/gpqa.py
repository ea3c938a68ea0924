"""`--rm-type gpqa`: multiple choice, the response's chosen letter against the correct one, with upstream's rules:
the correct letter is metadata['correct_letter'], else the label (a letter, an index, or a choice's text, compared
case- and punctuation-blind); without a chosen letter, a response that contains the correct answer's text scores.
Chain of thought before the last `</think>` is not read."""
from __future__ import annotations

import re
import string
from collections.abc import Iterable

from .math_utils import boxed_content

# the option letters when the sample names neither its choices nor its valid letters (upstream's default)
DEFAULT_VALID_LETTERS = list(string.ascii_uppercase[:10])
# strongest cue first; the last match of the first cue that names a valid letter wins
_CUES = (
    r"(?i:answer|option|choice)\s*(?:is|:)?\s*\(?\**([A-Z])\b",
    r"\b([A-Z])\s+is\s+(?:the\s+)?correct",
    r"\(([A-Z])\)",
    r"\b([A-Z])\b",
)
THINK_END = "</think>"


def _letters(metadata: dict | None) -> str:
    """The option letters: metadata['valid_letters'], else one per metadata['choices'], else A-J."""
    metadata = metadata or {}
    if metadata.get("valid_letters"):
        return "".join(str(letter).strip().upper() for letter in metadata["valid_letters"])
    choices = metadata.get("choices")
    return string.ascii_uppercase[:len(choices)] if choices else "".join(DEFAULT_VALID_LETTERS)


def _choices(metadata: dict | None) -> list:
    choices = (metadata or {}).get("choices") or []
    return list(choices.values()) if isinstance(choices, dict) else list(choices)


def _final_part(response: str) -> str:
    return response.rsplit(THINK_END, 1)[-1]


def _normalized(text) -> str:
    return re.sub(r"[^a-z0-9]+", " ", str(text).lower()).strip()


def _extract_letter_from_response(response: str | None, valid_letters: Iterable[str]) -> str | None:
    """The option letter the response commits to (after its last `</think>`): boxed, `answer is X` / `option: X`
    / `choice X`, `X is correct`, `(X)`, else the last standalone capital; None when it names no valid letter.
    Upstream's name (its GPQA tests import it)."""
    if not response:
        return None
    letters = {str(letter).upper() for letter in valid_letters}
    text = _final_part(response)
    boxed = boxed_content(text)
    if boxed is not None:
        found = [c for c in re.findall(r"\b([A-Z])\b", boxed.replace("\\text{", " ").replace("}", " ")) if c in letters]
        if found:
            return found[-1]
    for cue in _CUES:
        found = [c for c in re.findall(cue, text) if c in letters]
        if found:
            return found[-1]
    return None


def label_to_letter(label, metadata: dict | None, letters: str) -> str | None:
    """Label as a letter: a letter, an index, or the text of one of metadata['choices'] (case and punctuation
    aside)."""
    if isinstance(label, bool):
        return None
    if isinstance(label, (int, float)):
        index = int(label)
        return letters[index] if 0 <= index < len(letters) else None
    text = str(label).strip().strip("()").strip()
    if len(text) == 1 and text.upper() in letters:
        return text.upper()
    wanted = _normalized(text)
    for pos, choice in enumerate(_choices(metadata)):
        if wanted and _normalized(choice) == wanted and pos < len(letters):
            return letters[pos]
    return None


def compute_gpqa_reward(response: str | None, label, metadata: dict | None = None) -> float:
    """1.0 when the chosen letter is the correct one; with no letter chosen, 1.0 when the response contains the
    correct answer's text as whole words (its choice, metadata['correct_answer'] / ['answer_text'], or a text
    label); else 0.0."""
    if response is None:
        return 0.0
    metadata = metadata or {}
    letters = _letters(metadata)
    given = metadata.get("correct_letter")
    correct = given.strip().upper() if isinstance(given, str) else label_to_letter(label, metadata, letters)
    chosen = _extract_letter_from_response(response, letters)
    if chosen and correct:
        return 1.0 if chosen == correct else 0.0
    label_text = label.strip() if isinstance(label, str) else None
    targets = [metadata.get("correct_answer"), metadata.get("answer_text"), label_text]
    choices = _choices(metadata)
    if correct and correct in letters and letters.index(correct) < len(choices):
        targets.append(choices[letters.index(correct)])
    said = f" {_normalized(_final_part(response))} "
    if any(_normalized(t) and f" {_normalized(t)} " in said for t in targets if t):  # whole words only
        return 1.0
    return 1.0 if chosen and not correct and label_text and chosen == label_text.upper() else 0.0
