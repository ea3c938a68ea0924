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
