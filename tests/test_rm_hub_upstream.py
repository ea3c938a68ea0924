"""rm_hub's upstream-named helpers give upstream's answers on the cases upstream's own rm_hub tests document
(tests/test_rm_math.py and tests/test_rm_gpqa.py of THUDM/slime), as inputs and expected outputs; the code here is
this project's. The graders of --rm-type keep their own, more lenient extraction (tests/test_rm_hub.py)."""
from __future__ import annotations

import pytest

from slime.rollout.rm_hub import extract_boxed_answer as package_extract_boxed_answer
from slime.rollout.rm_hub.gpqa import DEFAULT_VALID_LETTERS, _extract_letter_from_response, compute_gpqa_reward
from slime.rollout.rm_hub.math_utils import (_strip_string, extract_answer, extract_boxed_answer, grade_answer_mathd,
                                             grade_answer_sympy, grade_answer_verl, last_boxed_only_string,
                                             mathd_normalize_answer, remove_boxed)


@pytest.mark.parametrize("text, boxed", [
    (r"first attempt \boxed{wrong}, final \boxed{42}", r"\boxed{42}"),
    (r"answer: \boxed{\frac{1}{2}}", r"\boxed{\frac{1}{2}}"),
    (r"answer: \fbox{7}", r"\fbox{7}"),
    ("plain text, no box", None),
    (r"start \boxed{never closes", None),
])
def test_last_boxed_only_string(text, boxed):
    assert last_boxed_only_string(text) == boxed


def test_remove_boxed_and_the_extractions():
    assert remove_boxed(r"\boxed{x+1}") == "x+1"
    assert remove_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert remove_boxed("not boxed at all") is None and remove_boxed(None) is None
    assert extract_boxed_answer(r"Solution: \boxed{42}") == "42" == package_extract_boxed_answer(r"so \boxed{42}")
    assert extract_answer("just 42") is None


@pytest.mark.parametrize("raw, normalized", [
    (r"\frac12", r"\frac{1}{2}"), (r"\tfrac{1}{2}", r"\frac{1}{2}"), (r"\left(1\right)", "(1)"), (r"45^{\circ}", "45"),
    (r"45^\circ", "45"), (".7", "0.7"), ("0.5", r"\frac{1}{2}"), (".5", r"\frac{1}{2}"), ("3/4", r"\frac{3}{4}"),
    ("1 + 1", "1+1"),
])
def test_strip_string(raw, normalized):
    assert _strip_string(raw) == normalized


def test_mathd_normalization_and_grade():
    assert mathd_normalize_answer(r"\text{42}") == "42" and mathd_normalize_answer(None) is None
    for given, truth in ((r"\frac{1}{2}", "0.5"), (r"\frac12", r"\frac{1}{2}"), (r"45^\circ", "45"),
                         ("3/4", r"\frac{3}{4}")):
        assert grade_answer_mathd(given, truth) is True
    assert grade_answer_mathd("42", "43") is False


def test_sympy_grade_compares_expressions_but_not_unreduced_fractions():
    assert grade_answer_sympy("x+1", "1+x") is True
    assert grade_answer_sympy(r"\frac{2}{4}", r"\frac{1}{2}") is False


def test_sympy_grade_never_runs_the_answer_as_code(tmp_path):
    marker = tmp_path / "ran"
    assert grade_answer_sympy(f"__import__('pathlib').Path('{marker}').touch()", "1") is False
    assert not marker.exists()


def test_verl_grade_reads_the_boxed_answers():
    assert grade_answer_verl(r"answer: \boxed{42}", r"\boxed{42}") is True
    assert grade_answer_verl("just 42", "42") is False
    assert grade_answer_verl(r"\boxed{42}", "") is False


@pytest.mark.parametrize("response, letter", [
    ("The answer is B.", "B"), ("Answer: C", "C"), ("My choice is D", "D"), ("A is correct here", "A"),
    ("E is the correct option", "E"), ("Final answer: B", "B"), ("the final option is C", "C"),
    ("we ruled out A, then B, settled on C", "C"),
    ("Let me think… Answer: A is wrong.</think>The answer is B.", "B"),  # chain of thought is not read
    ("no idea, sorry", None), ("", None), (None, None),
])
def test_gpqa_letter_extraction(response, letter):
    assert _extract_letter_from_response(response, DEFAULT_VALID_LETTERS) == letter


def test_gpqa_letter_extraction_keeps_to_the_valid_letters():
    assert _extract_letter_from_response("Answer: C, but actually A was right, no wait B.", ["A", "B"]) == "B"


@pytest.mark.parametrize("response, label, metadata, reward", [
    ("The answer is C.", "C", None, 1.0),
    ("The answer is C.", "D", None, 0.0),
    ("Answer: C", 2, {"choices": ["alpha", "beta", "gamma", "delta"]}, 1.0),
    ("Answer: B", 1, {"choices": {"a": "first", "b": "second", "c": "third"}}, 1.0),
    ("I think the answer is B.", "capital of france", {"choices": ["London", "Capital of France", "Berlin"]}, 1.0),
    ("Definitely paris.", "Paris", {"choices": ["London", "Paris", "Berlin"]}, 1.0),
    ("Answer: A", "anything", {"correct_letter": "a"}, 1.0),
    (None, "A", None, 0.0),
    ("random text", "some answer", None, 0.0),
])
def test_gpqa_reward(response, label, metadata, reward):
    assert compute_gpqa_reward(response, label, metadata=metadata) == reward
