"""Engine vs trainer log-probs without processes: what the embedded engine returns (SGLang's semantics),
the train/rollout diff metric and the mismatch flags in the loss, the weight-push faults, the flag checks."""
from __future__ import annotations

import math

import pytest
import torch

from slime.backends.embedded_engine.sampling import RETURN_ORIGINAL_LOGPROB_ENV, SamplingParams, sample_next_tokens
from slime.backends.megatron_utils.data import build_rollout_plans, pack_micro_batch
from slime.backends.megatron_utils.loss import (
    LOGPROB_DIFF_KEY,
    metric_keys,
    micro_batch_loss,
    trainer_computes_old_log_probs,
)
from slime.config import defaults_namespace
from slime.algorithms.policy_loss import ppo_clip_loss
from slime.config.loss import LossConfig
from slime.distributed import fault_inject
from slime.utils.arguments import parse_args
from slime.utils.ppo_utils import compute_advantages_and_returns

VOCAB = 11


# ----------------------------------------------------------------------------- the engine's log-probs
def _sample(params: SamplingParams, rows: int = 64, seed: int = 0):
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    tokens, logprobs = sample_next_tokens(logits, [params] * rows, torch.Generator().manual_seed(1))
    return logits, tokens, logprobs


def _log_softmax_at(logits, tokens, temperature):
    return torch.log_softmax(logits / temperature, -1).gather(1, tokens[:, None]).squeeze(1)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.6, top_k=3),
                                    SamplingParams(temperature=0.5, top_p=0.6)])
def test_engine_returns_tempered_log_probs_before_top_k_top_p(params, monkeypatch):
    monkeypatch.delenv(RETURN_ORIGINAL_LOGPROB_ENV, raising=False)
    logits, tokens, logprobs = _sample(params)
    # the tempered softmax over the whole vocabulary (top-k/top-p only pick the token) ...
    assert torch.allclose(logprobs, _log_softmax_at(logits, tokens, params.temperature), atol=1e-6)
    # ... which is not the temperature-1 distribution
    assert (logprobs - _log_softmax_at(logits, tokens, 1.0)).abs().max() > 0.1


def test_greedy_and_return_original_logprob_give_temperature_one(monkeypatch):
    monkeypatch.delenv(RETURN_ORIGINAL_LOGPROB_ENV, raising=False)
    logits, tokens, logprobs = _sample(SamplingParams(temperature=0.0))
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, _log_softmax_at(logits, tokens, 1.0), atol=1e-6)
    monkeypatch.setenv(RETURN_ORIGINAL_LOGPROB_ENV, "True")
    logits, tokens, logprobs = _sample(SamplingParams(temperature=0.6))
    assert torch.allclose(logprobs, _log_softmax_at(logits, tokens, 1.0), atol=1e-6)


# ----------------------------------------------------------------------------- the loss' metrics
def _rollout(with_engine_log_probs: bool = True) -> dict:
    rng = torch.Generator().manual_seed(3)
    data = {"tokens": [], "response_lengths": [], "loss_masks": [], "advantages": [], "log_probs": [],
            "rollout_log_probs": []}
    for prompt, response, masked in ((3, 4, 1), (2, 6, None), (4, 2, None)):
        data["tokens"].append(torch.randint(1, VOCAB, (prompt + response,), generator=rng).tolist())
        data["response_lengths"].append(response)
        data["loss_masks"].append([0 if j == masked else 1 for j in range(response)])
        data["advantages"].append([1.0 - 0.5 * len(data["tokens"])] * response)
        data["log_probs"].append((-torch.rand(response, generator=rng) * 3).tolist())
        data["rollout_log_probs"].append([v + 0.01 * (j + 1) for j, v in enumerate(data["log_probs"][-1])])
    if not with_engine_log_probs:
        del data["rollout_log_probs"]
    return data


def _cfg(**overrides) -> LossConfig:
    values = dict(calculate_per_token_loss=True, eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None, use_kl_loss=False,
                  kl_loss_coef=0.0, kl_loss_type="k1", entropy_coef=0.0, use_tis=False, tis_clip=2.0, tis_clip_low=0.0,
                  temperature=1.0, policy_loss=ppo_clip_loss)
    return LossConfig(**(values | overrides))


def _loss_and_metrics(data: dict, cfg: LossConfig):
    (plan,) = build_rollout_plans([len(t) for t in data["tokens"]], [sum(m) for m in data["loss_masks"]],
                                  num_steps=1, dp_size=1, dp_rank=0, use_dynamic_batch_size=False,
                                  max_tokens_per_gpu=None, cp_size=1, micro_batch_size=8, global_batch_size=None,
                                  balance_data=False, pad_multiple=2)
    packed = pack_micro_batch(data, plan.micro_batches[0], cp_size=1, cp_rank=0, tp_size=1, sequence_parallel=False)
    logits = torch.randn(packed.labels.numel(), VOCAB, generator=torch.Generator().manual_seed(5))
    return micro_batch_loss(logits, packed, plan, cfg, None, plugin_args=None)


def _expected_diff(data: dict) -> float:
    pairs = [(abs(old - eng), m) for olds, engs, mask in zip(data["log_probs"], data["rollout_log_probs"],
                                                              data["loss_masks"])
             for old, eng, m in zip(olds, engs, mask)]
    return sum(d * m for d, m in pairs) / sum(m for _, m in pairs)


@pytest.mark.parametrize("per_token", [True, False])
def test_logprob_diff_is_the_mean_over_loss_tokens_in_both_loss_modes(per_token):
    data = _rollout()
    _, metrics = _loss_and_metrics(data, _cfg(calculate_per_token_loss=per_token))
    assert float(metrics[LOGPROB_DIFF_KEY]) == pytest.approx(_expected_diff(data), rel=1e-5)


def test_logprob_diff_is_nan_without_engine_log_probs_and_the_keys_do_not_change():
    cfg = _cfg()
    loss, metrics = _loss_and_metrics(_rollout(with_engine_log_probs=False), cfg)
    assert math.isnan(float(metrics[LOGPROB_DIFF_KEY])) and math.isfinite(float(loss))
    assert tuple(sorted(metrics)) == metric_keys(cfg)


def test_use_rollout_logprobs_takes_the_engines_log_probs_as_old_policy():
    data = _rollout()
    trainer_old, _ = _loss_and_metrics(data, _cfg())
    engines_old, metrics = _loss_and_metrics(data, _cfg(use_rollout_logprobs=True))
    swapped = dict(data, log_probs=data["rollout_log_probs"])
    assert float(engines_old) == pytest.approx(float(_loss_and_metrics(swapped, _cfg())[0]), rel=1e-6)
    assert float(engines_old) != pytest.approx(float(trainer_old), rel=1e-4)
    without_engine = _rollout(with_engine_log_probs=False)
    with pytest.raises(ValueError, match="--use-rollout-logprobs"):
        _loss_and_metrics(without_engine, _cfg(use_rollout_logprobs=True))


def test_get_mismatch_metrics_reports_without_changing_the_loss_and_use_tis_changes_it():
    data = _rollout()
    plain, _ = _loss_and_metrics(data, _cfg())
    observed, metrics = _loss_and_metrics(data, _cfg(get_mismatch_metrics=True))
    corrected, _ = _loss_and_metrics(data, _cfg(use_tis=True))
    assert float(observed) == float(plain) and float(corrected) != pytest.approx(float(plain), rel=1e-4)
    assert {"tis", "tis_abs", "tis_clipfrac", "ois"} <= set(metrics)
    ratios = [math.exp(o - e) for olds, engs, mask in zip(data["log_probs"], data["rollout_log_probs"],
                                                           data["loss_masks"])
              for o, e, m in zip(olds, engs, mask) if m]
    assert float(metrics["tis"]) == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    assert float(metrics["tis_abs"]) == pytest.approx(sum(abs(r - 1) for r in ratios) / len(ratios), rel=1e-5)


def test_metric_keys_follow_the_flags_only():
    base = set(metric_keys(_cfg()))
    assert LOGPROB_DIFF_KEY in base
    assert set(metric_keys(_cfg(get_mismatch_metrics=True))) - base == {"tis", "tis_abs", "tis_clipfrac", "ois"}
    assert set(metric_keys(_cfg(use_tis=True))) == set(metric_keys(_cfg(get_mismatch_metrics=True)))


def test_old_policy_forward_is_skipped_only_for_use_rollout_logprobs_alone():
    assert trainer_computes_old_log_probs(_cfg())
    assert not trainer_computes_old_log_probs(_cfg(use_rollout_logprobs=True))
    assert trainer_computes_old_log_probs(_cfg(use_rollout_logprobs=True, get_mismatch_metrics=True))


def test_reward_shaping_kl_uses_the_engines_log_probs_with_use_rollout_logprobs():
    data = {"loss_masks": [[1, 1]], "rewards": [1.0], "log_probs": [[-1.0, -1.0]], "rollout_log_probs": [[-3.0, -2.0]],
            "ref_log_probs": [[-1.0, -1.0]]}
    args = dict(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=1.0, kl_loss_type="k1")
    trainer = dict(data)
    compute_advantages_and_returns(defaults_namespace(**args, use_rollout_logprobs=False), trainer)
    engines = dict(data)
    compute_advantages_and_returns(defaults_namespace(**args, use_rollout_logprobs=True), engines)
    assert trainer["returns"] == [[1.0, 1.0]]  # trainer's old policy equals the reference: no shaping
    assert engines["returns"] == [[3.0, 2.0]]  # 1 - (rollout - ref)


# ----------------------------------------------------------------------------- weight-push faults
@pytest.fixture
def faults(monkeypatch):
    def set_faults(value: str) -> None:
        monkeypatch.setenv(fault_inject.ENV_VAR, value)
        fault_inject.reset_fault_cache()

    yield set_faults
    monkeypatch.delenv(fault_inject.ENV_VAR, raising=False)
    fault_inject.reset_fault_cache()


def test_weight_push_faults_fire_on_their_rank_and_rollout_only(faults):
    tensors = [("a", torch.ones(3, 2)), ("b", torch.zeros(4))]
    faults("skip_weight_push@0#1,corrupt_weight_push@0#2")
    assert fault_inject.apply_weight_push_fault(tensors, 0, 1) == []
    corrupted = fault_inject.apply_weight_push_fault(tensors, 0, 2)
    assert [name for name, _ in corrupted] == ["a", "b"]
    assert all(t.shape == c.shape and (t - c).abs().max() > 0.01 for (_, t), (_, c) in zip(tensors, corrupted))
    for rank, rollout in ((0, 0), (0, 3), (1, 1), (1, 2)):
        assert fault_inject.apply_weight_push_fault(tensors, rank, rollout) is tensors


# ----------------------------------------------------------------------------- flag checks
BASE_FLAGS = ["--rollout-batch-size", "2", "--num-rollout", "1", "--actor-num-gpus-per-node", "1",
              "--train-backend-device", "cpu"]


def _parse(*flags):
    return parse_args([*BASE_FLAGS, *flags])


def test_mismatch_flags_parse():
    args = _parse("--use-rollout-logprobs", "--get-mismatch-metrics")
    assert args.use_rollout_logprobs and args.get_mismatch_metrics
    assert not _parse().use_rollout_logprobs


def test_use_rollout_logprobs_with_use_tis_is_refused(capsys):
    with pytest.raises(SystemExit):
        _parse("--use-rollout-logprobs", "--use-tis")
    assert "--use-rollout-logprobs and --use-tis" in capsys.readouterr().err


def test_return_original_logprob_with_a_temperature_is_refused_for_the_maths_and_warned_otherwise(
        monkeypatch, capsys):
    monkeypatch.setenv(RETURN_ORIGINAL_LOGPROB_ENV, "1")
    with pytest.raises(SystemExit):
        _parse("--rollout-temperature", "0.7", "--use-rollout-logprobs")
    assert RETURN_ORIGINAL_LOGPROB_ENV in capsys.readouterr().err
    with pytest.warns(UserWarning, match="train_rollout_logprob_abs_diff compares different distributions"):
        _parse("--rollout-temperature", "0.7")
