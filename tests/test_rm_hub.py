"""Rule-based graders and the reward dispatch, on hand-written cases."""
import asyncio
import functools
import sys
import textwrap
from types import SimpleNamespace

import pytest

from slime.config import defaults_namespace
from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from slime.rollout.rm_hub.f1 import f1_score
from slime.rollout.rm_hub.gpqa import compute_gpqa_reward
from slime.rollout.rm_hub.math_dapo_utils import compute_score
from slime.rollout.rm_hub.math_utils import boxed_content, extract_math_answer, grade_answer, last_boxed_only_string
from slime.utils.types import Sample


def test_boxed_extraction_handles_nesting_and_last_box():
    assert boxed_content("first \\boxed{1} then \\boxed{\\frac{2}{3}}.") == "\\frac{2}{3}"
    assert last_boxed_only_string("\\boxed{a{b}c}") == "\\boxed{a{b}c}"
    assert boxed_content("\\boxed 5$") == "5" and boxed_content("\\fbox{6}") == "6"  # what the graders here read
    assert boxed_content("no box") is None
    assert boxed_content("\\boxed{unclosed") is None


@pytest.mark.parametrize("given,truth", [
    ("\\frac{1}{2}", "0.5"), ("\\dfrac12", "1/2"), ("1,000", "1000"), ("x = 5", "5"), ("10\\%", "10"),
    ("90^\\circ", "90"), ("7.0", "7"), ("\\text{(A)}", "(a)"), ("\\sqrt{2}", "\\sqrt2"), ("-3", "-3"), (".5", "0.5"),
])
def test_grade_answer_equivalent(given, truth):
    assert grade_answer(given, truth)


@pytest.mark.parametrize("given,truth", [("3", "4"), ("\\frac{1}{3}", "0.33"), ("", "0"), (None, "1"), ("1/0", "1")])
def test_grade_answer_different(given, truth):
    assert not grade_answer(given, truth)


def test_math_answer_falls_back_to_final_number():
    assert extract_math_answer("3 + 4 = 7, so the answer is 7.") == "7"
    assert extract_math_answer("we get \\boxed{12} (not 13)") == "12"


_args = functools.partial(defaults_namespace, rm_type="math")


def _rm(args, response, label, **sample_kw):
    return asyncio.run(async_rm(args, Sample(response=response, label=label, **sample_kw)))


def test_math_rm_scores_one_or_zero():
    assert _rm(_args(), "The answer is \\boxed{7}", "7") == 1
    assert _rm(_args(), "I think 3 + 4 = 8", "7") == 0
    assert _rm(_args(), "nothing", "7") == 0


def test_deepscaler_requires_think_end_and_box():
    assert get_deepscaler_rule_based_reward("<think>hmm \\boxed{3}</think> so \\boxed{4}", "4") == 1
    assert get_deepscaler_rule_based_reward("<think>...</think> so \\boxed{4}", "\\boxed{4}") == 1
    assert get_deepscaler_rule_based_reward("<think>...</think> so \\boxed{4}", ["5", "4"]) == 1
    assert get_deepscaler_rule_based_reward("no think block \\boxed{4}", "4") == 0
    assert get_deepscaler_rule_based_reward("<think>\\boxed{4}</think> the answer is 4", "4") == 0


def test_dapo_answer_line_scores_plus_minus_one():
    good = compute_score("long reasoning...\nAnswer: 42", "42")
    assert good == {"score": 1.0, "acc": True, "pred": "42"}
    assert compute_score("Answer: 41", "42")["score"] == -1.0
    assert compute_score("no answer line", "42") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert compute_score("Answer: \\boxed{\\frac{1}{2}}", "0.5")["acc"]
    assert compute_score("Answer: 7 ... \\boxed{7}", "7", strict_box_verify=True)["acc"]
    # dict reward trains through --reward-key score
    reward = _rm(_args(rm_type="dapo"), "Answer: 5", "5")
    assert Sample(reward=reward).get_reward_value(SimpleNamespace(reward_key="score")) == 1.0


def test_f1_token_overlap():
    assert f1_score("The Eiffel Tower", "eiffel tower") == (1.0, 1.0, 1.0)
    f1, precision, recall = f1_score("paris france city", "paris")
    assert precision == pytest.approx(1 / 3) and recall == 1.0 and f1 == pytest.approx(0.5)
    assert f1_score("london", "paris")[0] == 0.0
    assert f1_score("paris", ["london", "paris"])[0] == 1.0
    assert _rm(_args(rm_type="f1"), "Paris!", "paris") == 1.0


def test_gpqa_letter_choice():
    assert compute_gpqa_reward("Reasoning... The answer is (C).", "C") == 1.0
    assert compute_gpqa_reward("Answer: B", "C") == 0.0
    assert compute_gpqa_reward("so \\boxed{D}", "D") == 1.0
    assert compute_gpqa_reward("I pick (b)... final (A)", 0) == 1.0
    choices = {"choices": ["red", "green", "blue", "cyan", "pink"]}
    assert compute_gpqa_reward("Answer: E", "pink", metadata=choices) == 1.0
    assert compute_gpqa_reward("nothing chosen", "A") == 0.0


def test_rm_type_from_metadata_and_boxed_prefix():
    assert _rm(_args(rm_type="math"), "Paris", "paris", metadata={"rm_type": "f1"}) == 1.0
    assert _rm(_args(rm_type="boxed_f1"), "blah \\boxed{paris} blah", "paris") == 1.0


def test_unknown_or_missing_rm_type_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="'nope'"):
        _rm(_args(rm_type="nope"), "x", "y")
    with pytest.raises(ValueError, match="--rm-type or --custom-rm-path"):
        _rm(_args(rm_type=None), "x", "y")


@pytest.fixture
def custom_rm_module(tmp_path, monkeypatch):
    (tmp_path / "my_rm_f.py").write_text(textwrap.dedent("""
        async def rm(args, sample):
            return float(len(sample.response))

        async def group_rm(args, samples):
            return [float(i) for i, _ in enumerate(samples)]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rm_f"
    sys.modules.pop("my_rm_f", None)


def test_custom_rm_path_overrides_rm_type(custom_rm_module):
    assert _rm(_args(custom_rm_path=f"{custom_rm_module}.rm", rm_type="math"), "abcd", "7") == 4.0


def test_batched_rm_rule_based_and_custom_group(custom_rm_module):
    samples = [Sample(response="\\boxed{7}", label="7"), Sample(response="\\boxed{6}", label="7")]
    assert asyncio.run(batched_async_rm(_args(), samples)) == [1, 0]
    group_args = _args(custom_rm_path=f"{custom_rm_module}.group_rm")
    assert asyncio.run(batched_async_rm(group_args, samples)) == [0.0, 1.0]


@pytest.mark.timeout(60)
def test_remote_rm_posts_prompt_response_label():
    from aiohttp import web

    from slime.utils.ports import find_free_port

    seen = []

    async def handler(request):
        seen.append(await request.json())
        return web.json_response(0.75)

    async def scenario():
        app = web.Application()
        app.router.add_post("/rm", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = find_free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            args = _args(rm_type="remote_rm", rm_url=f"http://127.0.0.1:{port}/rm")
            return await async_rm(args, Sample(prompt="p", response="r", label="l"))
        finally:
            await runner.cleanup()

    assert asyncio.run(scenario()) == 0.75
    assert seen == [{"prompt": "p", "response": "r", "label": "l"}]


def test_remote_rm_without_url_fails_clearly():
    with pytest.raises(ValueError, match="--rm-url"):
        _rm(_args(rm_type="remote_rm"), "r", "l")
