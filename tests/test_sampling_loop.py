"""The default rollout's group collection against a fake SGLang engine: over-sampling, dynamic filters,
partial rollout (abort, buffer, resume, off-policy masking), the rollout-side hooks and filter_hub."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import hook_plugins
from rollout_testing import engine, fresh_generate_state, tokenizer_dir  # noqa: F401 (fixtures)
from rollout_testing import rollout_args, write_jsonl
from slime.rollout.data_source import RolloutDataSourceWithBuffer, pop_first, pop_stalest
from slime.rollout.filter_hub.base_types import DynamicFilterOutput, call_dynamic_filter, should_drop_dynamic_filter_output
from slime.rollout.filter_hub.dynamic_sampling_filters import (
    check_reward_nonzero_std,
    check_reward_nonzero_std_with_fallback,
)
from slime.rollout.sglang_rollout import generate_and_rm, generate_rollout, run, sampling_params
from slime.utils.types import Sample

pytestmark = pytest.mark.timeout(120)
PLUGINS = f"{Path(hook_plugins.__file__).resolve()}"
PROMPTS = [{"prompt": f"what is {i} + {i} ?", "label": str(2 * i)} for i in range(1, 9)]




def make_args(tokenizer_dir, tmp_path, port, **kw):
    fields = dict(seed=1, rollout_batch_size=2, custom_rm_path=f"{PLUGINS}:index_parity_rm",
                  hook_log=str(tmp_path / "hooks.jsonl"), sglang_server_concurrency=64)
    return rollout_args(tokenizer_dir, write_jsonl(tmp_path / "p.jsonl", PROMPTS), port, **{**fields, **kw})


def _records(args, hook):
    path = Path(args.hook_log)
    return [r for r in hook_plugins.read_records(path) if r["hook"] == hook] if path.exists() else []


# ---------------------------------------------------------------- filter_hub


def _group(rewards):
    return [Sample(index=i, reward=r) for i, r in enumerate(rewards)]


def test_check_reward_nonzero_std_keeps_only_groups_with_spread():
    args = SimpleNamespace(reward_key=None)
    kept = check_reward_nonzero_std(args, _group([0.0, 1.0, 0.0]))
    dropped = check_reward_nonzero_std(args, _group([1.0, 1.0, 1.0]))
    assert kept.keep and kept.reason is None
    assert not dropped.keep and dropped.reason == "zero_std_1.0"
    # a generate function that returned several samples per prompt: the first one carries the reward
    assert check_reward_nonzero_std(args, [[Sample(reward=0.0)], [Sample(reward=1.0)]]).keep
    fallback = check_reward_nonzero_std_with_fallback(args, _group([0.0, 0.0]))
    assert not fallback.keep and fallback.keep_when_insufficient
    assert not should_drop_dynamic_filter_output(fallback, remaining_batch_size=2, target_data_size=2)
    assert should_drop_dynamic_filter_output(fallback, remaining_batch_size=3, target_data_size=2)


def test_call_dynamic_filter_wraps_bare_bools():
    assert call_dynamic_filter(None, None, []).keep
    assert call_dynamic_filter(lambda args, group: False, None, []) == DynamicFilterOutput(keep=False)


# ---------------------------------------------------------------- over-sampling and dynamic filtering


def test_dynamic_filter_drops_zero_std_groups_and_draws_more(tokenizer_dir, tmp_path, engine):
    args = make_args(tokenizer_dir, tmp_path, engine.port, rollout_batch_size=2, over_sampling_batch_size=2,
                     n_samples_per_prompt=2, custom_rm_path=f"{PLUGINS}:group_parity_rm",
                     dynamic_sampling_filter_path="slime.rollout.filter_hub.dynamic_sampling_filters."
                                                  "check_reward_nonzero_std")
    output = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    kept = [g[0].group_index for g in output.samples]
    assert kept == [1, 3]  # groups 0 and 2 (all rewards 0) were dropped, two more prompts drawn
    assert output.metrics["rollout/dynamic_filter/drop_zero_std_0.0"] == 2.0
    assert output.metrics["rollout/sampling/drawn_groups"] == 4.0 and output.metrics["rollout/sampling/rounds"] == 2.0
    assert output.metrics["rollout/zero_std_group_ratio"] == 0.0


def test_filter_that_rejects_everything_fails_with_a_bounded_number_of_rounds(tokenizer_dir, tmp_path, engine,
                                                                               monkeypatch):
    from slime.rollout import sampling_loop

    monkeypatch.setattr(sampling_loop, "MAX_SAMPLING_ROUNDS", 3)
    args = make_args(tokenizer_dir, tmp_path, engine.port, custom_rm_path=None, rm_type="math",
                     dynamic_sampling_filter_path=f"{PLUGINS}:reject_all")
    with pytest.raises(RuntimeError, match="kept 0 of --rollout-batch-size 2 groups after 3 rounds"):
        generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))


# ---------------------------------------------------------------- partial rollout


def _partial_args(tokenizer_dir, tmp_path, engine, **kw):
    # one group of two in flight at a time: when group 0 is done the rollout is full, group 1 is
    # in flight (aborted with 2 tokens) and group 2 still queued (aborted with none)
    engine.delay_s = 0.3
    return make_args(tokenizer_dir, tmp_path, engine.port, rollout_batch_size=1, over_sampling_batch_size=3,
                     n_samples_per_prompt=2, sglang_server_concurrency=2, partial_rollout=True,
                     mask_offpolicy_in_partial_rollout=True, buffer_filter_path=f"{PLUGINS}:buffer_filter", **kw)


def test_partial_rollout_aborts_buffers_and_resumes_groups(tokenizer_dir, tmp_path, engine):
    args = _partial_args(tokenizer_dir, tmp_path, engine)
    source = RolloutDataSourceWithBuffer(args)
    first = generate_rollout(args, 0, source)
    assert [g[0].group_index for g in first.samples] == [0]
    assert engine.abort_calls >= 1
    assert [[s.group_index for s in g] for g in source.buffer] == [[1, 1], [2, 2]]
    in_flight, queued = source.buffer
    assert all(s.status is Sample.Status.ABORTED for s in in_flight + queued)
    assert [s.response_length for s in in_flight] == [2, 2] and [s.response_length for s in queued] == [0, 0]
    assert all(s.metadata["start_rollout_id"] == 0 for s in in_flight)
    assert all("start_rollout_id" not in s.metadata for s in queued)
    assert first.metrics["rollout/partial/buffered_groups"] == 2.0
    assert first.metrics["rollout/partial/buffered_tokens"] == 4.0

    engine.delay_s = 0.0
    source.rollout_id = 1
    second = generate_rollout(args, 1, source)
    resumed = second.samples[0]
    assert [s.group_index for s in resumed] == [1, 1]  # the buffer is served first
    prompt_len = len(engine.requests[0]["input_ids"])
    for sample in resumed:
        # the fake engine answers its 4 tokens after the 2 kept ones
        assert sample.status is Sample.Status.COMPLETED and sample.response_length == 6
        # the 2 tokens of the earlier policy are masked out of the loss, the 4 new ones are trained on
        assert sample.loss_mask == [0, 0, 1, 1, 1, 1] and len(sample.rollout_log_probs) == 6
    resume_requests = [r for r in engine.requests if len(r["input_ids"]) == prompt_len + 2]
    assert resume_requests and all(r["sampling_params"]["max_new_tokens"] == 16 - 2 for r in resume_requests)
    filtered = _records(args, "buffer_filter")
    assert filtered[0]["rollout_id"] == 1 and filtered[0]["num_samples"] == 3
    assert [[s["response_length"] for s in g] for g in filtered[0]["groups"]] == [[2, 2], [0, 0]]


def test_without_partial_rollout_in_flight_groups_are_dropped(tokenizer_dir, tmp_path, engine):
    args = _partial_args(tokenizer_dir, tmp_path, engine)
    args.partial_rollout = args.mask_offpolicy_in_partial_rollout = False
    source = RolloutDataSourceWithBuffer(args)
    output = generate_rollout(args, 0, source)
    assert len(output.samples) == 1 and source.buffer == [] and engine.abort_calls >= 1


def test_buffer_filters():
    args = SimpleNamespace()
    old, new, never = ([Sample(weight_versions=v)] for v in (["3", "4"], ["5"], []))
    buffer = [new, never, old]
    assert pop_first(args, 0, buffer, 1) == [new] and buffer == [never, old]
    assert pop_stalest(args, 0, buffer, 1) == [old] and buffer == [never]


# ---------------------------------------------------------------- rollout-side hooks


def test_rollout_hooks_called_with_upstream_signatures(tokenizer_dir, tmp_path, engine):
    args = make_args(tokenizer_dir, tmp_path, engine.port,
                     custom_generate_function_path=f"{PLUGINS}:generate",
                     rollout_sample_hook_path=[f"{PLUGINS}:sample_hook"],
                     rollout_sample_filter_path=f"{PLUGINS}:sample_filter",
                     rollout_all_samples_process_path=f"{PLUGINS}:all_samples_process")
    output = generate_rollout(args, 5, RolloutDataSourceWithBuffer(args))
    samples = [s for g in output.samples for s in g]
    assert all(s.metadata["generate_hook"] == "train" and s.metadata["sample_hook_rollout"] == 5 for s in samples)
    assert [s.remove_sample for s in samples] == [False, True, False, True]
    assert [s.reward for s in samples] == [0.0, 1.0, 0.0, 1.0]
    assert [r["rollout_id"] for r in _records(args, "sample_hook")] == [5] * 4
    assert _records(args, "sample_filter") == [{"hook": "sample_filter", "pid": _records(args, "sample_filter")[0]["pid"],
                                               "groups": 2}]
    assert _records(args, "all_samples_process")[0]["groups"] == 2


def test_generate_and_rm_passes_evaluation_and_accepts_sample_lists(tokenizer_dir, tmp_path, engine):
    args = make_args(tokenizer_dir, tmp_path, engine.port, custom_generate_function_path=f"{PLUGINS}:generate")
    sample = run(generate_and_rm(args, Sample(prompt="what is 1 ?", index=3), sampling_params(args), evaluation=True))
    assert sample.metadata["generate_hook"] == "eval" and sample.reward == 1.0
    args.custom_generate_function_path = f"{PLUGINS}:generate_two_segments"
    pieces = run(generate_and_rm(args, Sample(prompt="what is 1 ?", index=3), sampling_params(args)))
    assert isinstance(pieces, list) and len(pieces) == 2 and all(p.reward == 1.0 for p in pieces)
