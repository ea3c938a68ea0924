"""Math answer extraction and equivalence: \\boxed{...} or the final number, normalised, compared.

The comparison is deliberately conservative: two answers match when their normalised strings are
equal or when both parse to numbers that agree to 1e-6 relative (fractions, decimals, percents).
"""
from __future__ import annotations

import math
import re

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(rf"(?<![\w.])(?:{_NUMBER})(?:\s*/\s*(?:{_NUMBER}))?")


def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed{...}` / `\\fbox{...}` (with balanced braces) or `\\boxed x` in text."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    head = text[start:brace] if brace >= 0 else text[start:]
    if brace < 0 or head.strip() not in ("\\boxed", "\\fbox"):
        # "\boxed 5" form: the token after a space
        tail = text[start:].split("$")[0]
        return tail if " " in tail else None
    depth = 0
    for pos in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            return text[start : pos + 1]
    return None


def _box_content(boxed: str) -> str:
    """`\\boxed{x}` / `\\fbox{x}` -> `x`; `\\boxed x` -> `x` (what last_boxed_only_string returns)."""
    for prefix in ("\\boxed ", "\\fbox "):
        if boxed.startswith(prefix):
            return boxed[len(prefix) :].strip()
    open_at = boxed.find("{")
    return boxed[open_at + 1 : -1]


def boxed_content(text: str) -> str | None:
    """Content of the last boxed expression (`\\boxed{}`, `\\fbox{}`, `\\boxed x`), or None: what the graders
    here read."""
    boxed = last_boxed_only_string(text or "")
    return _box_content(boxed) if boxed is not None else None


def extract_final_number(text: str) -> str | None:
    """The last number in text (integers, decimals, `a/b`), or None."""
    matches = _NUMBER_RE.findall(text or "")
    return matches[-1].strip() if matches else None


def _strip_text_wrappers(s: str) -> str:
    # \text{cm} and \mbox{...} keep their content: "5\text{ cm}" -> "5 cm"
    return re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)


def _canonical_frac(s: str) -> str:
    # \frac12 -> \frac{1}{2}; \frac{1}2 -> \frac{1}{2}; \sqrt2 -> \sqrt{2}
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\w)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    return re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)


def normalize_answer(answer: str | None) -> str:
    """A canonical string form of a math answer (latex noise, units, spacing, case removed)."""
    if answer is None:
        return ""
    s = str(answer).strip()
    s = _strip_text_wrappers(s)
    for noise in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "$"):
        s = s.replace(noise, "")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac")
    s = re.sub(r"\^\{?\\circ\}?", "", s).replace("°", "")
    s = s.replace("\\%", "").replace("%", "")
    s = _canonical_frac(s)
    # "x = 5" -> "5" when the left side is a short variable name
    if re.match(r"^\s*[a-zA-Z]\w{0,2}\s*=", s):
        s = s.split("=", 1)[1]
    s = s.strip().rstrip(".").strip()
    # thousands separators inside numbers: 1,000 -> 1000
    s = re.sub(r"(?<=\d),(?=\d{3}(?:\D|$))", "", s)
    s = s.replace(" ", "").lower()
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    if s.startswith("."):
        s = "0" + s
    return s


def to_number(s: str) -> float | None:
    """A float for `3`, `-2.5`, `1/2`, `\\frac{1}{2}`, `-\\frac{3}{4}`; None otherwise."""
    s = normalize_answer(s)
    frac = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s)
    if frac:
        sign, num, den = frac.groups()
        return _safe_div(float(num), float(den), negate=bool(sign))
    ratio = re.fullmatch(r"(-?[\d.]+)/(-?[\d.]+)", s)
    if ratio:
        return _safe_div(float(ratio.group(1)), float(ratio.group(2)))
    try:
        return float(s)
    except ValueError:
        return None


def _safe_div(num: float, den: float, negate: bool = False) -> float | None:
    if den == 0:
        return None
    value = num / den
    return -value if negate else value


def grade_answer(given: str | None, ground_truth: str | int | float | None) -> bool:
    """True when `given` is equivalent to `ground_truth` (string-normalised or numerically)."""
    if given is None or ground_truth is None:
        return False
    a, b = normalize_answer(given), normalize_answer(str(ground_truth))
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    if x is None or y is None:
        return False
    return math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)


def extract_math_answer(response: str) -> str | None:
    """Boxed answer if present, else the final number of the response."""
    boxed = boxed_content(response)
    return boxed if boxed is not None else extract_final_number(response)


def grade_math_response(response: str, label) -> bool:
    """`--rm-type math`: the response's answer equals the label (any of them when label is a list)."""
    labels = label if isinstance(label, (list, tuple)) else [label]
    answer = extract_math_answer(response)
    return any(grade_answer(answer, truth) for truth in labels)


def grade_answer_verl(solution_str: str, ground_truth) -> bool:
    """Upstream's boxed-only grade that example plug-ins import: the `\\boxed{...}` answer of `solution_str` against
    `ground_truth` (itself possibly boxed), equal after MATH normalisation (grade_answer_mathd) or as expressions
    (grade_answer_sympy); False when either is missing."""
    if not ground_truth:
        return False
    truth = str(ground_truth)
    if "\\boxed" in truth:
        truth = extract_answer(truth)
    given = extract_answer(solution_str or "")
    if given is None:
        return False
    return grade_answer_mathd(given, truth) or grade_answer_sympy(given, truth)


def _strip_string(string: str) -> str:
    """The MATH dataset's answer normalisation (upstream keeps this private name; plug-ins import it).

    Unlike normalize_answer it keeps case, and turns `0.5` and integer `a/b` into `\\frac{a}{b}`.
    """
    s = str(string).replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    s = s.split("\\text{ ")[0] if "\\text{ " in s else s  # trailing units
    s = s.replace("\\%", "").replace("%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> "5"
        s = sides[1]
    s = _canonical_frac(s.replace(" ", ""))
    if s == "0.5":
        return "\\frac{1}{2}"
    ratio = re.fullmatch(r"(-?\d+)/(-?\d+)", s)
    return f"\\frac{{{ratio.group(1)}}}{{{ratio.group(2)}}}" if ratio else s


# ---------------------------------------------------------------- upstream's names for plug-in authors
# These return what upstream's functions of the same names return (tests/test_rm_hub_upstream.py); the graders
# above use the lenient boxed_content.

def remove_boxed(boxed: str | None) -> str | None:
    """The content of a string that is exactly `\\boxed{...}`; None for anything else (unboxed text, None)."""
    if not isinstance(boxed, str) or not boxed.startswith("\\boxed{") or not boxed.endswith("}"):
        return None
    return boxed[len("\\boxed{") : -1]


def extract_boxed_answer(solution: str) -> str | None:
    """Content of the last `\\boxed{...}` of `solution`, or None (a `\\fbox{...}` gives None, as upstream's)."""
    return remove_boxed(last_boxed_only_string(solution or ""))


def extract_answer(passage: str) -> str | None:
    """extract_boxed_answer when the passage holds a `\\boxed`, else None."""
    return extract_boxed_answer(passage) if "\\boxed" in (passage or "") else None


def mathd_normalize_answer(answer: str | None) -> str | None:
    """The MATH-dataset normalisation of one answer (a surrounding `\\text{...}` dropped first); None stays None."""
    if answer is None:
        return None
    text = str(answer).strip()
    wrapped = re.fullmatch(r"\\text\{(.+?)\}", text)
    return _strip_string(wrapped.group(1).strip() if wrapped else text)


def grade_answer_mathd(given_answer: str | None, ground_truth: str | None) -> bool:
    """True when both answers are equal after mathd_normalize_answer."""
    given, truth = mathd_normalize_answer(given_answer), mathd_normalize_answer(ground_truth)
    return given is not None and truth is not None and given == truth


def grade_answer_sympy(given_answer: str | None, ground_truth: str | None) -> bool:
    """Upstream's lenient grade: the answers (tuples and intervals element by element) are equal as written, or as
    expressions of at most two unknowns (`x+1` and `1+x`); fractions must match exactly (`2/4` is not `1/2`) and an
    integer answer must be written as one. Expressions are read by math_expressions.py's whitelist parser, which
    never evaluates the model's text as Python."""
    from .math_expressions import equal_as_expressions, plain_answer, split_elements

    truth, given = plain_answer(ground_truth), plain_answer(given_answer)
    if truth is None:
        return False
    if truth == given:
        return True
    if not given:
        return False
    truth_parts, given_parts = split_elements(truth), split_elements(given)
    if len(truth_parts) > 1 and (truth[0] != given[0] or truth[-1] != given[-1]):
        return False  # a tuple against an interval, or open against closed
    if len(truth_parts) != len(given_parts):
        return False
    return all(_elements_equal(t, g, equal_as_expressions) for t, g in zip(truth_parts, given_parts))


_FRACTION = re.compile(r"-?\d+\.?/0*[1-9]\d*\.?")


def _elements_equal(truth: str, given: str, equal_as_expressions) -> bool:
    if _FRACTION.fullmatch(truth) and _FRACTION.fullmatch(given):
        return truth == given  # an unreduced fraction is not the reduced one
    if _is_integer(truth) != _is_integer(given):
        return False
    return equal_as_expressions(truth, given)


def _is_integer(text: str) -> bool:
    try:
        value = float(re.sub(r"(\d),(\d{3})(?=$|\D)", r"\1\2", text))
    except ValueError:
        return False
    return math.isfinite(value) and abs(value - round(value)) <= 1e-7
