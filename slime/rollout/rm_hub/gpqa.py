"""`--rm-type gpqa`: multiple choice, the response's chosen letter against the label's letter."""
from __future__ import annotations

import re
import string

from .math_utils import extract_answer

# the option letters when the sample names neither its choices nor its valid letters (upstream's default)
DEFAULT_VALID_LETTERS = list(string.ascii_uppercase[:10])
# strongest cue first; the last match of the first pattern that matches wins
_CUES = (
    r"(?i)answer\s*(?:is|:)\s*\(?\**([A-Z])\b",
    r"\(([A-Z])\)",
    r"\b([A-Z])\b",
)


def _letters(metadata: dict | None) -> str:
    """The option letters: metadata['valid_letters'], else one per metadata['choices'], else A-J."""
    metadata = metadata or {}
    if metadata.get("valid_letters"):
        return "".join(str(letter).strip().upper() for letter in metadata["valid_letters"])
    choices = metadata.get("choices")
    return string.ascii_uppercase[:len(choices)] if choices else "".join(DEFAULT_VALID_LETTERS)


def extract_choice(response: str, letters: str) -> str | None:
    """The letter the response commits to (boxed, `answer is X`, `(X)`, last bare letter)."""
    boxed = extract_answer(response)
    if boxed is not None:
        found = re.findall(r"\b([A-Z])\b", boxed.replace("\\text{", " ").replace("}", " "))
        found = [c for c in found if c in letters]
        if found:
            return found[-1]
    for cue in _CUES:
        found = [c for c in re.findall(cue, response) if c in letters]
        if found:
            return found[-1]
    return None


def label_to_letter(label, metadata: dict | None, letters: str) -> str | None:
    """Label as a letter: a letter, an index, or the text of one of metadata['choices']."""
    if isinstance(label, int):
        return letters[label] if 0 <= label < len(letters) else None
    text = str(label).strip().strip("()").strip()
    if len(text) == 1 and text.upper() in letters:
        return text.upper()
    choices = (metadata or {}).get("choices") or []
    if isinstance(choices, dict):
        choices = [choices[k] for k in sorted(choices)]
    for pos, choice in enumerate(choices):
        if str(choice).strip() == text:
            return letters[pos]
    return None


def compute_gpqa_reward(response: str, label, metadata: dict | None = None) -> float:
    """1.0 when the chosen letter equals the label's letter, else 0.0."""
    letters = _letters(metadata)
    truth = label_to_letter(label, metadata, letters)
    chosen = extract_choice(response or "", letters)
    return 1.0 if truth is not None and chosen == truth else 0.0
