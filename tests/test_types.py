"""Sample record and rollout-function output types (upstream plugin surface)."""
from types import SimpleNamespace

import pytest

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, call_rollout_fn
from slime.utils.types import Sample


def test_sample_defaults_and_status_values():
    sample = Sample()
    assert sample.status is Sample.Status.PENDING
    assert sample.tokens == [] and sample.weight_versions == [] and sample.metadata == {}
    assert [s.value for s in Sample.Status] == ["pending", "completed", "truncated", "aborted", "failed"]
    # mutable defaults are per instance
    other = Sample()
    sample.tokens.append(1)
    assert other.tokens == []


def test_to_dict_from_dict_round_trip_keeps_unknown_keys():
    sample = Sample(group_index=2, index=9, prompt="p", tokens=[1, 2, 3], response="r", response_length=1,
                    label="7", reward=1.0, loss_mask=[1], rollout_log_probs=[-0.5], status=Sample.Status.TRUNCATED,
                    metadata={"k": 1})
    data = sample.to_dict()
    assert data["status"] == "truncated"
    data["plugin_field"] = "x"
    back = Sample.from_dict(data)
    assert back.status is Sample.Status.TRUNCATED
    assert back.tokens == [1, 2, 3] and back.rollout_log_probs == [-0.5] and back.metadata == {"k": 1}
    assert back.plugin_field == "x"


def test_get_reward_value_scalar_and_keyed():
    assert Sample(reward=0.5).get_reward_value(SimpleNamespace(reward_key=None)) == 0.5
    keyed = Sample(index=3, reward={"score": -1.0, "acc": False})
    assert keyed.get_reward_value(SimpleNamespace(reward_key="score")) == -1.0
    with pytest.raises(KeyError, match="reward-key 'missing'"):
        keyed.get_reward_value(SimpleNamespace(reward_key="missing"))
    with pytest.raises(TypeError, match="--reward-key"):
        keyed.get_reward_value(SimpleNamespace(reward_key=None))


@pytest.mark.parametrize("finish,status", [("length", Sample.Status.TRUNCATED), ("stop", Sample.Status.COMPLETED),
                                           ("abort", Sample.Status.ABORTED)])
def test_update_from_meta_info(finish, status):
    sample = Sample()
    sample.update_from_meta_info(SimpleNamespace(), {"finish_reason": {"type": finish}, "weight_version": 4})
    assert sample.status is status
    assert sample.weight_versions == ["4"]


def test_effective_response_length_uses_loss_mask():
    assert Sample(response_length=4).effective_response_length == 4
    assert Sample(response_length=4, loss_mask=[1, 0, 0, 1]).effective_response_length == 2


def _groups(args, rollout_id, data_source, evaluation=False):
    return [[Sample(index=0), Sample(index=1)]]


def test_call_rollout_fn_wraps_legacy_returns():
    train = call_rollout_fn(_groups, None, 0, None, evaluation=False)
    assert isinstance(train, RolloutFnTrainOutput) and train.samples[0][1].index == 1 and train.metrics is None
    evaluation = call_rollout_fn(lambda *a, evaluation: {"d": {"rewards": [1]}}, None, evaluation=True)
    assert isinstance(evaluation, RolloutFnEvalOutput) and evaluation.data["d"]["rewards"] == [1]
    passthrough = RolloutFnTrainOutput(samples=[[Sample()]], metrics={"m": 1})
    assert call_rollout_fn(lambda *a, evaluation: passthrough, evaluation=False) is passthrough


def test_call_rollout_fn_rejects_flat_sample_list():
    with pytest.raises(TypeError, match="list\\[list\\[Sample\\]\\]"):
        call_rollout_fn(lambda *a, evaluation: [Sample(), Sample()], evaluation=False)


def test_round_trip_keeps_every_field_and_flattens_the_info_records():
    sample = Sample(index=1, tokens=[1, 2], response_length=1, loss_mask=[1], weight_versions=["2"],
                    remove_sample=True, train_metadata={"loss": "sft"}, session_id="s", non_generation_time=0.5)
    sample.spec_info.spec_accept_token_num = 3
    sample.prefix_cache_info.cached_tokens = 7
    data = sample.to_dict()
    assert data["spec_info"] == {"spec_accept_token_num": 3, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                                 "completion_token_num": 0}
    assert data["prefix_cache_info"] == {"cached_tokens": 7, "total_prompt_tokens": 0}
    back = Sample.from_dict(data)
    assert back == sample  # every dataclass field, info records included
    assert set(data) >= set(Sample.__dataclass_fields__)


def test_meta_info_unknown_finish_keeps_status_and_counters_accumulate():
    sample = Sample(status=Sample.Status.ABORTED)
    sample.update_from_meta_info(SimpleNamespace(), {"finish_reason": {"type": "weird"}, "cached_tokens": 2,
                                                    "prompt_tokens": 5, "spec_accept_token_num": 9})
    sample.update_from_meta_info(SimpleNamespace(), {"cached_tokens": 1, "prompt_tokens": 5})
    assert sample.status is Sample.Status.ABORTED and sample.weight_versions == []
    assert (sample.prefix_cache_info.cached_tokens, sample.prefix_cache_info.total_prompt_tokens) == (3, 10)
    assert sample.prefix_cache_info.prefix_cache_hit_rate == pytest.approx(0.3)
    assert sample.spec_info.spec_accept_token_num == 0  # no speculative decoding configured
    sample.update_from_meta_info(SimpleNamespace(sglang_speculative_algorithm="EAGLE"),
                                 {"spec_accept_token_num": 4, "spec_draft_token_num": 8, "completion_tokens": 6,
                                  "spec_verify_ct": 2})
    assert sample.spec_info.spec_accept_rate == 0.5 and sample.spec_info.spec_accept_length == 3.0


def test_append_response_tokens_keeps_tokens_mask_and_logprobs_aligned():
    sample = Sample(tokens=[1, 2, 3])
    sample.append_response_tokens(tokens=[10, 11], log_probs=[-0.1, -0.2], text="ab",
                                  meta_info={"finish_reason": {"type": "stop"}, "weight_version": "1"})
    sample.append_response_tokens(tokens=[20, 21, 22], trainable=False, text="<tool>")  # a tool reply
    sample.append_response_tokens(tokens=[12], log_probs=[-0.3], meta_info={"finish_reason": {"type": "length"}})
    assert sample.tokens == [1, 2, 3, 10, 11, 20, 21, 22, 12] and sample.response_length == 6
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1]
    assert sample.rollout_log_probs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]
    assert sample.response == "ab<tool>" and sample.status is Sample.Status.TRUNCATED
    assert sample.weight_versions == ["1"] and sample.effective_response_length == 3
    with pytest.raises(ValueError, match="log-probs"):
        sample.append_response_tokens(tokens=[1], trainable=True)
    with pytest.raises(ValueError, match="non-trainable"):
        sample.append_response_tokens(tokens=[1], log_probs=[0.0], trainable=False)
    with pytest.raises(ValueError, match="2 log-probs for 1 tokens"):
        sample.append_response_tokens(tokens=[1], log_probs=[0.0, 0.1])
    assert sample.response_length == 6  # failed appends change nothing


# upstream's Sample fields, by name (its plug-ins set and read them)
UPSTREAM_SAMPLE_FIELDS = {
    "group_index", "index", "rollout_id", "prompt", "tokens", "multimodal_inputs", "multimodal_train_inputs",
    "multimodal_train_input_id", "apply_chat_template_kwargs", "response", "response_length", "label", "reward",
    "loss_mask", "weight_versions", "rollout_log_probs", "rollout_top_p_token_ids", "rollout_top_p_token_offsets",
    "rollout_routed_experts", "remove_sample", "teacher_log_probs", "status", "metadata", "generate_function_path",
    "custom_rm_path", "train_metadata", "session_id", "non_generation_time", "spec_info", "prefix_cache_info",
}


def test_sample_has_upstreams_fields_and_their_dict_form_round_trips():
    assert set(Sample.__dataclass_fields__) == UPSTREAM_SAMPLE_FIELDS
    sample = Sample(rollout_id=4, index=4, multimodal_train_input_id="img-1",
                    apply_chat_template_kwargs={"enable_thinking": False}, rollout_top_p_token_ids=[5, 6, 7],
                    rollout_top_p_token_offsets=[0, 2, 3], response_length=2, teacher_log_probs=[-0.1, -0.2],
                    status=Sample.Status.COMPLETED)
    data = sample.to_dict()
    assert set(data) == UPSTREAM_SAMPLE_FIELDS
    assert data["rollout_id"] == 4 and data["status"] == "completed"
    assert data["apply_chat_template_kwargs"] == {"enable_thinking": False}
    back = Sample.from_dict(data)
    assert back == sample
    assert back.to_dict() == data
    # the short name plug-ins use for the offsets reads and writes the same field
    assert back.rollout_top_p_offsets == [0, 2, 3]
    back.rollout_top_p_offsets = [0, 1, 3]
    assert back.rollout_top_p_token_offsets == [0, 1, 3]
    assert Sample().apply_chat_template_kwargs is not Sample().apply_chat_template_kwargs
