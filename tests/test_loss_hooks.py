"""Loss plug-ins (custom TIS, pg-loss reducer, custom loss), sft_loss, GSPO's sequence-level ratio and
--normalize-advantages on one packed micro-batch (single process, no collectives)."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

import hook_plugins
from train_step_harness import loss_args
from slime.backends.megatron_utils.data import pack_micro_batch, plans_from_rollout
from slime.config import defaults_namespace
from slime.backends.megatron_utils.loss import metric_keys, micro_batch_loss
from slime.config.loss import build_loss_config
from slime.backends.megatron_utils.loss_hooks import ResponseView, sequence_mean_log_ratio
from slime.utils.ppo_utils import compute_advantages_and_returns

PLUGINS = str(Path(hook_plugins.__file__).resolve())
VOCAB = 11


def _data():
    torch.manual_seed(0)
    tokens = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10], [3, 3, 4, 5, 9]]
    responses = [3, 2, 4]
    data = {
        "tokens": tokens, "response_lengths": responses,
        "loss_masks": [[1, 1, 1], [1, 1], [1, 0, 1, 1]],
        "advantages": [[0.5] * 3, [-1.0] * 2, [2.0] * 4],
        "rollout_log_probs": [[-1.0, -2.0, -0.5], [-1.5, -1.0], [-0.7, -0.9, -1.1, -2.0]],
        "log_probs": [[-1.1, -1.9, -0.6], [-1.4, -1.2], [-0.8, -0.9, -1.0, -2.1]],
    }
    return data


# an asymmetric clip range; the hook plug-ins log nowhere unless a test gives them a file
_args = functools.partial(loss_args, eps_clip_high=0.28, hook_log=None)


def _batch(args):
    data = _data()
    plan = plans_from_rollout(data, args, dp_size=1, dp_rank=0)[0]
    packed = pack_micro_batch(data, plan.micro_batches[0], cp_size=1, cp_rank=0, tp_size=1, sequence_parallel=False)
    logits = torch.randn(packed.labels.numel(), VOCAB, requires_grad=True)
    return packed, plan, logits


def _loss(args, packed, plan, logits):
    return micro_batch_loss(logits, packed, plan, build_loss_config(args), None, plugin_args=args)


def test_response_view_takes_each_samples_response_tokens():
    packed, _, _ = _batch(_args())
    view = ResponseView.of(packed)
    assert view.sizes == tuple(packed.response_lengths)
    masks = view.split(packed.loss_mask)
    assert sorted(m.tolist() for m in masks) == sorted([[1, 1, 1], [1, 1], [1, 0, 1, 1]])
    back = view.scatter(view.take(packed.loss_mask), packed.loss_mask)
    assert torch.equal(back, packed.loss_mask)


def test_custom_tis_plugin_replaces_the_weights_and_its_masks_apply(tmp_path):
    args = _args(use_tis=True, custom_tis_function_path=f"{PLUGINS}:tis", hook_log=str(tmp_path / "h.jsonl"))
    packed, plan, logits = _batch(args)
    loss, metrics = _loss(args, packed, plan, logits)
    _, plain_metrics = _loss(_args(), packed, plan, logits)
    # the plug-in keeps the pg loss and drops each sample's last response token: redo that by hand
    dropped = packed.loss_mask.clone()
    view = ResponseView.of(packed)
    for positions in view.positions.split(list(view.sizes)):
        dropped[positions[-1]] = 0
    record = hook_plugins.read_records(tmp_path / "h.jsonl")[0]
    assert record["hook"] == "tis" and sorted(record["sizes"]) == sorted(packed.response_lengths)
    assert "plugin_tis_ratio" in metrics and "tis" not in metric_keys(build_loss_config(args))
    assert metrics["pg_loss"].item() != pytest.approx(plain_metrics["pg_loss"].item())
    # same per-sample denominators, fewer tokens in the numerator
    assert metrics["pg_loss"].item() == pytest.approx(_pg_with_masks(_args(), packed, plan, logits, dropped))
    assert loss.requires_grad


def _pg_with_masks(args, packed, plan, logits, mask) -> float:
    from slime.backends.megatron_utils.loss import policy_token_terms, target_log_probs, token_entropy, token_weights

    cfg = build_loss_config(args)
    terms = policy_token_terms(target_log_probs(logits, packed, cfg, None), token_entropy(logits, packed, cfg, None),
                               packed, cfg, plugin_args=args)
    return float((terms["pg_loss"].detach() * token_weights(packed, plan, cfg) * mask).sum())


def test_custom_pg_reducer_divides_by_a_constant():
    args = _args(custom_pg_loss_reducer_function_path=f"{PLUGINS}:pg_reducer")
    packed, plan, logits = _batch(args)
    _, metrics = _loss(args, packed, plan, logits)
    from slime.backends.megatron_utils.loss import policy_token_terms, target_log_probs, token_entropy

    cfg = build_loss_config(args)
    terms = policy_token_terms(target_log_probs(logits, packed, cfg, None), token_entropy(logits, packed, cfg, None),
                               packed, cfg, plugin_args=args)
    expected = (terms["pg_loss"] * packed.loss_mask).sum() / hook_plugins.PG_REDUCER_CONSTANT
    assert metrics["pg_loss"].item() == pytest.approx(expected.item())


def test_custom_loss_gets_upstream_batch_and_matches_sft_loss(tmp_path):
    args = _args(loss_type="custom_loss", custom_loss_function_path=f"{PLUGINS}:custom_loss",
                 hook_log=str(tmp_path / "h.jsonl"))
    packed, plan, logits = _batch(args)
    loss, metrics = _loss(args, packed, plan, logits)
    sft, sft_metrics = _loss(_args(loss_type="sft_loss"), packed, plan, logits)
    assert loss.item() == pytest.approx(sft.item()) and metrics["plugin_nll"].item() == pytest.approx(sft.item())
    assert sft.item() > 0 and sorted(sft_metrics) == ["loss", "train_rollout_logprob_abs_diff"]
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    record = hook_plugins.read_records(tmp_path / "h.jsonl")[0]
    assert record["samples"] == 3 and record["sizes"] == record["response_lengths"]


def test_gspo_uses_one_ratio_per_sample():
    packed, plan, logits = _batch(_args())
    ppo_kl = torch.randn(packed.labels.numel()) * packed.loss_mask
    per_token = sequence_mean_log_ratio(ppo_kl, packed)
    view = ResponseView.of(packed)
    for kl, mask, seq in zip(view.split(ppo_kl), view.split(packed.loss_mask), view.split(per_token)):
        mean = (kl * mask).sum() / mask.sum()
        assert torch.allclose(seq[mask.bool()], mean.expand(int(mask.sum())))
        assert torch.all(seq[~mask.bool()] == 0)
    grpo, _ = _loss(_args(), packed, plan, logits)
    gspo, _ = _loss(_args(advantage_estimator="gspo"), packed, plan, logits)
    assert gspo.item() != pytest.approx(grpo.item())


def test_normalize_advantages_whitens_grpo_advantages():
    data = {"loss_masks": [[1, 1], [1, 0, 1]], "rewards": [1.0, -0.5], "response_lengths": [2, 3]}
    compute_advantages_and_returns(defaults_namespace(advantage_estimator="grpo", normalize_advantages=False), data)
    assert data["advantages"] == [[1.0, 1.0], [-0.5, -0.5, -0.5]]
    compute_advantages_and_returns(defaults_namespace(advantage_estimator="grpo", normalize_advantages=True), data)
    values = torch.tensor([a for row, m in zip(data["advantages"], data["loss_masks"]) for a, k in zip(row, m) if k])
    assert values.mean().item() == pytest.approx(0.0, abs=1e-6) and values.std(unbiased=False).item() == pytest.approx(1.0, rel=1e-4)


def test_a_rollout_with_more_samples_than_prompts_x_n_is_split_into_the_planned_steps():
    from slime.backends.megatron_utils.data import build_rollout_plans

    # a generate function returned 10 samples for a rollout planned as 2 steps of 4
    plans = build_rollout_plans([8] * 10, [4] * 10, num_steps=2, dp_size=1, dp_rank=0, use_dynamic_batch_size=True,
                                max_tokens_per_gpu=64, cp_size=1, micro_batch_size=1, global_batch_size=4,
                                balance_data=False, pad_multiple=2)
    assert [p.step_sample_count for p in plans] == [5, 5]
    assert sorted(i for p in plans for mb in p.micro_batches for i in mb) == list(range(10))


def test_policy_loss_forwards_eps_clip_c(monkeypatch):
    from slime.algorithms import policy_loss as loss_module  # the estimators' PPO-clip term calls it

    seen = {}
    real = loss_module.compute_policy_loss

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(loss_module, "compute_policy_loss", spy)
    args = _args(eps_clip_c=3.0)
    packed, plan, logits = _batch(args)
    # a large ratio on every token: the dual clip bounds the loss of the negative-advantage sample
    packed = dataclasses.replace(packed, old_log_probs=torch.full_like(packed.loss_mask, -20.0))
    _, dual = _loss(args, packed, plan, logits)
    assert seen["eps_clip_c"] == 3.0 and seen["eps_clip"] == 0.2 and seen["eps_clip_high"] == 0.28
    _, plain = _loss(_args(), packed, plan, logits)
    assert dual["pg_loss"].item() < plain["pg_loss"].item()


def test_cispo_step_loss_is_the_clipped_weight_times_advantage_times_log_prob():
    args = _args(advantage_estimator="cispo")
    packed, plan, logits = _batch(args)
    loss, metrics = _loss(args, packed, plan, logits)
    mask = packed.loss_mask
    lp = torch.log_softmax(logits.detach(), -1).gather(-1, packed.labels.unsqueeze(-1)).squeeze(-1) * mask
    weight = torch.exp(lp - packed.old_log_probs * mask).clamp(0.8, 1.28)
    per_sample = mask * packed.sample_weight / plan.step_sample_count
    expected = (-weight * packed.advantages * lp * per_sample).sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["pg_loss"].item() == pytest.approx(expected.item(), rel=1e-5)
    grpo, _ = _loss(_args(), packed, plan, logits)
    assert grpo.item() != pytest.approx(loss.item())
