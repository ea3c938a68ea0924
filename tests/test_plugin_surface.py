"""Upstream's plug-in surface by name and behaviour: generate_and_rm's choice of generate function and its
list results, GenerateState.rollout_id, rm_hub / filter_hub names, processing_utils, cp_utils."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from slime.config import defaults_namespace
from slime.rollout import sglang_rollout
from slime.utils.misc import SingletonMeta
from slime.utils.types import Sample

pytestmark = pytest.mark.ranks


# ------------------------------------------------------------------ generate_and_rm

class _State:
    """What generate_and_rm reads of GenerateState (the real one loads the tokenizer)."""

    def __init__(self, args):
        self.args, self.aborted, self.rollout_id = args, False, 5
        self.semaphore = asyncio.Semaphore(4)


async def _named(tag, args, sample, sampling_params, evaluation=False):
    sample.tokens, sample.response, sample.response_length = [1, 2], tag, 1
    sample.reward, sample.status = 1.0, Sample.Status.COMPLETED
    sample.metadata["evaluation"] = evaluation
    return sample


async def _global(args, sample, sampling_params):  # no `evaluation`: it is not passed
    return await _named("global", args, sample, sampling_params)


async def _per_sample(args, sample, sampling_params, evaluation=False):
    return await _named("per-sample", args, sample, sampling_params, evaluation)


async def _two_samples(args, sample, sampling_params):
    sibling = Sample(index=sample.index + 100, tokens=[3, 4], response_length=1, status=Sample.Status.COMPLETED)
    sample.tokens, sample.response_length, sample.status = [1, 2], 1, Sample.Status.COMPLETED
    return [sample, sibling]


@pytest.fixture
def patched(monkeypatch):
    hooks = {"pkg.global": _global, "pkg.per_sample": _per_sample, "pkg.two": _two_samples}
    monkeypatch.setattr(sglang_rollout, "GenerateState", _State)
    monkeypatch.setattr(sglang_rollout, "load_function", lambda path: hooks[path])  # the module's own name
    return sglang_rollout


def test_generate_function_of_the_sample_wins_over_the_global_one(patched):
    args = defaults_namespace(custom_generate_function_path="pkg.global")
    chosen = asyncio.run(patched.generate_and_rm(args, Sample(index=0, generate_function_path="pkg.per_sample"),
                                                 {}, evaluation=True))
    assert chosen.response == "per-sample" and chosen.metadata["evaluation"] is True
    plain = asyncio.run(patched.generate_and_rm(args, Sample(index=1), {}, evaluation=True))
    assert plain.response == "global"


def test_group_rm_rewards_the_list_a_custom_generate_returns(patched, monkeypatch):
    seen = []

    async def group_rm(args, samples):
        seen.append([s.index for s in samples])
        return [0.5 * (i + 1) for i in range(len(samples))]

    from slime.rollout import rm_hub

    monkeypatch.setattr(rm_hub, "load_function", lambda path: {"pkg.rm": group_rm}[path])
    args = defaults_namespace(custom_generate_function_path="pkg.two", group_rm=True, custom_rm_path="pkg.rm")
    one = asyncio.run(patched.generate_and_rm(args, Sample(index=0), {}))
    assert isinstance(one, list) and [s.index for s in one] == [0, 100] and one[0].reward is None
    group = asyncio.run(patched.generate_and_rm_group(args, [Sample(index=0), Sample(index=1)], {}))
    assert seen == [[0, 100, 1, 101]]  # the whole group, list results flattened, in order
    assert [s.reward for item in group for s in item] == [0.5, 1.0, 1.5, 2.0]


def test_generate_state_carries_the_rollout_id(tmp_path):
    from slime.tools.char_tokenizer import save_char_tokenizer

    save_char_tokenizer(tmp_path, "0123456789")
    SingletonMeta.reset(sglang_rollout.GenerateState)
    try:
        # top_p/top_k None: the sampling params these args always gave (the parser's defaults would add them)
        state = sglang_rollout.GenerateState(defaults_namespace(hf_checkpoint=str(tmp_path), rollout_temperature=1.0,
                                                                rollout_top_p=None, rollout_top_k=None))
        assert state.rollout_id is None
        state.reset(7)
        assert sglang_rollout.GenerateState(None).rollout_id == 7 and not state.aborted
    finally:
        SingletonMeta.reset(sglang_rollout.GenerateState)


# ------------------------------------------------------------------ rm_hub / filter_hub names

def test_rm_hub_names_upstreams_plugins_import():
    from slime.rollout.rm_hub import grade_answer_verl
    from slime.rollout.rm_hub.f1 import normalize_answer
    from slime.rollout.rm_hub.gpqa import DEFAULT_VALID_LETTERS, compute_gpqa_reward
    from slime.rollout.rm_hub.math_utils import _strip_string

    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert [_strip_string(s) for s in ("\\dfrac12", "0.5", "3/4", "k = 5", "\\frac1{72}", "5\\text{ cm}", ".5")] == \
        ["\\frac{1}{2}", "\\frac{1}{2}", "\\frac{3}{4}", "5", "\\frac{1}{72}", "5", "\\frac{1}{2}"]
    assert _strip_string("\\left( 1, 2 \\right)") == "(1,2)" and _strip_string("X") == "X"  # case is kept
    assert grade_answer_verl("so \\boxed{\\frac{1}{2}}", "0.5") and grade_answer_verl("\\boxed{4}", "\\boxed{4}")
    assert not grade_answer_verl("it is 4", "4") and not grade_answer_verl("\\boxed{4}", "")
    assert DEFAULT_VALID_LETTERS == list("ABCDEFGHIJ")
    assert compute_gpqa_reward("The answer is H", "H") == 1.0  # ten options when the sample names none
    assert compute_gpqa_reward("The answer is H", "D", metadata={"choices": ["a", "b", "c", "d"]}) == 0.0
    assert compute_gpqa_reward("answer: B", "B", metadata={"valid_letters": ["A", "B"]}) == 1.0


def test_rm_hub_exposes_upstreams_package_and_math_utils_names():
    from slime.rollout import rm_hub
    from slime.rollout.rm_hub import (async_rm, batched_async_rm, compute_gpqa_reward, compute_score_dapo,  # noqa: F401
                                      extract_boxed_answer, f1_score, get_deepscaler_rule_based_reward, remote_rm)
    from slime.rollout.rm_hub.math_utils import (extract_answer, grade_answer_mathd, grade_answer_sympy,
                                                 last_boxed_only_string, mathd_normalize_answer, remove_boxed)

    assert set(rm_hub.__all__) <= set(dir(rm_hub))
    assert extract_boxed_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}" == extract_answer("\\boxed{\\frac{1}{2}}")
    assert extract_boxed_answer("no box") is None
    assert remove_boxed(last_boxed_only_string("a \\boxed{x^{2}} b")) == "x^{2}"
    assert mathd_normalize_answer("\\text{0.5}") == "\\frac{1}{2}" and mathd_normalize_answer(None) is None
    assert grade_answer_mathd("\\dfrac12", "0.5") and not grade_answer_mathd(None, "1")
    assert grade_answer_sympy("50\\%", "50") and grade_answer_sympy("1/4", "0.25") and not grade_answer_sympy("x+1", "2")


def test_rm_type_random_is_a_seeded_coin_that_needs_no_label(capsys):
    from slime.rollout.rm_hub import async_rm
    from slime.utils.arguments import parse_args

    args = SimpleNamespace(rm_type="random", custom_rm_path=None, seed=1)
    rewards = [asyncio.run(async_rm(args, Sample(index=i, response=f"r{i}"))) for i in range(64)]
    assert set(rewards) == {0, 1} and 16 < sum(rewards) < 48
    again = [asyncio.run(async_rm(args, Sample(index=i, response=f"r{i}"))) for i in range(64)]
    assert again == rewards  # the same sample gets the same reward (exact resume)
    parsed = parse_args(["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
                         "--train-backend-device", "cpu", "--rm-type", "random"])
    assert parsed.rm_type == "random"


class _UpstreamState:
    """A plug-in's own state, as upstream's GenerateState: a semaphore, no rollout_id, no aborted."""

    def __init__(self, args):
        self.args, self.semaphore = args, asyncio.Semaphore(2)


def test_a_state_without_the_optional_fields_still_generates(monkeypatch):
    monkeypatch.setattr(sglang_rollout, "GenerateState", _UpstreamState)
    monkeypatch.setattr(sglang_rollout, "load_function", lambda path: {"pkg.global": _global}[path])
    args = defaults_namespace(custom_generate_function_path="pkg.global", seed=1)
    done = asyncio.run(sglang_rollout.generate_and_rm_group(args, [Sample(index=0), Sample(index=1)], {}))
    assert [s.response for s in done] == ["global", "global"] and all(s.reward == 1.0 for s in done)


def test_deepscaler_grades_the_tail_after_the_response_marker():
    from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward as reward

    assert reward("Question...###Response the sum is \\boxed{7}", "7") == 1
    assert reward("<think>a</think> \\boxed{1} <think>b</think> so \\boxed{7}", "7") == 1  # after the last </think>
    assert reward("<think>\\boxed{7}</think> nothing boxed after", "7") == 0
    assert reward("no marker \\boxed{7}", "7") == 0


def test_dynamic_filter_drop_rule_by_upstreams_name():
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput, should_drop_dynamic_filter_output

    assert not should_drop_dynamic_filter_output(DynamicFilterOutput(keep=True), remaining_batch_size=9,
                                                 target_data_size=1)
    lenient = DynamicFilterOutput(keep=False, keep_when_insufficient=True)
    assert not should_drop_dynamic_filter_output(lenient, remaining_batch_size=4, target_data_size=4)
    assert should_drop_dynamic_filter_output(lenient, remaining_batch_size=5, target_data_size=4)
    assert should_drop_dynamic_filter_output(DynamicFilterOutput(keep=False), remaining_batch_size=1,
                                             target_data_size=4)


# ------------------------------------------------------------------ processing_utils, cp_utils

def test_processing_utils(tmp_path):
    from slime.tools.char_tokenizer import save_char_tokenizer
    from slime.utils.processing_utils import build_processor_kwargs, load_processor, load_tokenizer

    save_char_tokenizer(tmp_path, "0123456789")
    assert load_tokenizer(str(tmp_path))("123")["input_ids"] == [4, 5, 6]
    assert load_processor(str(tmp_path)) is None  # a text model has no multimodal processor
    kwargs = build_processor_kwargs({"images": ["img"], "images_kwargs": {"max_pixels": 9}})
    assert kwargs["images"] == ["img"] and kwargs["images_kwargs"] == {"max_pixels": 9, "return_tensors": "pt"}
    assert kwargs["text_kwargs"] == {"return_tensors": None, "return_mm_token_type_ids": False}
    assert kwargs["videos_kwargs"] == kwargs["audio_kwargs"] == {"return_tensors": "pt"}
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(str(empty))


@pytest.mark.parametrize("total, response, cp, padded", [(10, 4, 2, None), (10, 4, 4, None), (17, 9, 2, 24),
                                                        (7, 6, 1, None), (12, 1, 3, None)])
def test_cp_response_pieces_match_the_zigzag_layout_of_the_packed_batch(total, response, cp, padded):
    from slime.backends.megatron_utils.cp_utils import response_slices
    from slime.backends.megatron_utils.data import zigzag_slice
    from slime.utils.misc import round_up

    length = padded or round_up(total, 2 * cp)
    first = total - response - 1
    positions = torch.full((length,), -1)
    positions[first: first + response] = torch.arange(response)  # response index held at each position
    gathered = []
    for rank in range(cp):
        held = [int(v) for v in zigzag_slice(positions, cp, rank) if v >= 0]
        a, b = response_slices(total, response, cp, rank, padded)
        assert held == list(range(response))[a] + list(range(response))[b]
        gathered += held
    assert sorted(gathered) == list(range(response))


def test_cp_helpers_without_context_parallelism_return_their_input():
    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp

    values = torch.arange(3.0)
    assert slice_log_prob_with_cp([0.1, 0.2, 0.3], 5, 3) == [0.1, 0.2, 0.3]
    assert all_gather_with_cp(values, 5, 3) is values
    with pytest.raises(ValueError, match="2 values for a response of 3"):
        slice_log_prob_with_cp([0.1, 0.2], 5, 3)


def _cp_gather_rank(rank, world):
    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from train_step_harness import layout_args

    init_model_parallel(layout_args({"context_parallel_size": world}))
    total, response = 11, 6
    whole = torch.arange(1.0, response + 1)
    mine = slice_log_prob_with_cp(whole, total, response).clone().requires_grad_(True)
    gathered = all_gather_with_cp(mine, total, response)
    (gathered * torch.arange(1.0, response + 1)).sum().backward()
    return mine.detach().tolist(), gathered.detach().tolist(), mine.grad.tolist(), \
        slice_log_prob_with_cp(list(whole.tolist()), total, response)


@pytest.mark.timeout(120)
def test_all_gather_with_cp_rebuilds_the_response_and_carries_the_gradient_back():
    from mp_utils import run_ranks

    results = run_ranks(_cp_gather_rank, 2, timeout_s=110)
    parts = [mine for mine, _, _, _ in results]
    assert sorted(v for part in parts for v in part) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # every token once
    for mine, gathered, grad, as_list in results:
        assert gathered == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and as_list == mine
        # each rank's loss reads the whole response; the all-reduce sums both ranks' gradients back to the owner
        assert grad == [2.0 * v for v in mine]


def test_plugin_surfaces_take_the_parsers_default_for_a_field_a_hand_built_args_lacks():
    """Upstream's plug-in tests build small args objects with the fields upstream reads; what this project reads
    beyond them (--seed, the data source's prompt and shuffle flags) comes from the parser's defaults."""
    import asyncio
    from types import SimpleNamespace

    from slime.rollout.data_source import RolloutDataSourceWithBuffer
    from slime.rollout.rm_hub import async_rm
    from slime.rollout.sampling_seed import sample_seed, seeded_params
    from slime.utils.types import Sample

    source = RolloutDataSourceWithBuffer(SimpleNamespace(rollout_global_dataset=False, n_samples_per_prompt=2,
                                                         buffer_filter_path=None))
    assert [[s.index for s in group] for group in source.get_samples(2)] == [[0, 1], [2, 3]]
    seeded = seeded_params(SimpleNamespace(), {"temperature": 1.0}, 3, 5, False)
    assert seeded["sampling_seed"] == sample_seed(1234, 3, 5, False)  # --seed's default
    reward = asyncio.run(async_rm(SimpleNamespace(custom_rm_path=None, rm_type="random"), Sample(index=1, response="x")))
    assert reward in (0, 1)
