"""PPO math against hand-computed values (pure CPU)."""

import math

import pytest
import torch

from slime.config import defaults_namespace
from slime.utils.ppo_utils import (
    compute_advantages_and_returns,
    compute_approx_kl,
    compute_cispo_loss,
    compute_entropy_from_logits,
    compute_log_probs,
    compute_policy_loss,
    compute_tis_weights,
    compute_value_loss,
    get_advantages_and_returns,
    get_grpo_returns,
    get_reinforce_plus_plus_returns,
)
from slime.algorithms.rewards import group_normalize


def test_approx_kl_estimators():
    lp, base = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = lp - base  # [0.5, -1.0]
    assert compute_approx_kl(lp, base, "k1").tolist() == pytest.approx(d.tolist())
    assert compute_approx_kl(lp, base, "k2").tolist() == pytest.approx([0.125, 0.5])
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]
    assert compute_approx_kl(lp, base, "k3").tolist() == pytest.approx(k3, rel=1e-6)
    big = compute_approx_kl(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl")
    assert big.item() == 10.0
    with pytest.raises(ValueError):
        compute_approx_kl(lp, base, "k9")


def test_policy_loss_clip_hand_values():
    # ratio = exp(-ppo_kl): 1.5 (clipped above at 1.2 for A>0), 0.5 (clipped below at 0.8 for A<0), 1.0
    ratio = torch.tensor([1.5, 0.5, 1.0, 1.5])
    adv = torch.tensor([1.0, -1.0, 2.0, -1.0])
    loss, clipfrac = compute_policy_loss(-ratio.log(), adv, 0.2, 0.2)
    assert loss.tolist() == pytest.approx([-1.2, 0.8, -2.0, 1.5], rel=1e-6)
    assert clipfrac.tolist() == [1.0, 1.0, 0.0, 0.0]
    loss_hi, _ = compute_policy_loss(-ratio.log(), adv, 0.2, 0.28)
    assert loss_hi[0].item() == pytest.approx(-1.28)
    dual, _ = compute_policy_loss(-torch.tensor([5.0]).log(), torch.tensor([-1.0]), 0.2, 0.2, eps_clip_c=3.0)
    assert dual.item() == pytest.approx(3.0)


def test_tis_weights():
    old, rollout = torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-1.0, -3.0, 1.0])
    w, frac = compute_tis_weights(old, rollout, clip_high=2.0, clip_low=0.5)
    assert w.tolist() == pytest.approx([1.0, 2.0, 0.5])
    assert frac.tolist() == [0.0, 1.0, 1.0]


def test_log_probs_and_entropy_unsharded():
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    lp = compute_log_probs(logits, torch.tensor([1, 0]))
    assert lp.tolist() == pytest.approx([math.log(0.75), math.log(0.5)], rel=1e-6)
    h = compute_entropy_from_logits(logits)
    expected0 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert h.tolist() == pytest.approx([expected0, math.log(2.0)], rel=1e-6)


def test_returns_and_gae():
    assert get_grpo_returns([0.5], [torch.zeros(3)])[0].tolist() == [0.5, 0.5, 0.5]
    kl = [torch.tensor([0.1, 0.2, 0.3])]
    mask = [torch.tensor([1.0, 1.0, 0.0])]
    (ret,) = get_reinforce_plus_plus_returns([1.0], kl, mask, kl_coef=1.0, gamma=1.0)
    # token rewards: [-0.1, -0.2 + 1.0, 0]; reverse cumsum
    assert ret.tolist() == pytest.approx([0.7, 0.8, 0.0])
    values = torch.tensor([0.5, 0.25])
    rewards = torch.tensor([0.0, 1.0])
    adv, returns = get_advantages_and_returns(4, 2, values, rewards, gamma=0.5, lambd=0.5)
    d1 = 1.0 - 0.25
    d0 = 0.0 + 0.5 * 0.25 - 0.5
    assert adv.tolist() == pytest.approx([d0 + 0.25 * d1, d1])
    assert returns.tolist() == pytest.approx([d0 + 0.25 * d1 + 0.5, d1 + 0.25])


def test_group_normalize_and_advantages():
    norm = group_normalize([1.0, 0.0, 1.0, 1.0, 2.0, 3.0], [0, 0, 0, 1, 1, 1], divide_by_std=True)
    std0 = torch.tensor([1.0, 0.0, 1.0]).std().item()
    assert norm[0] == pytest.approx((1 - 2 / 3) / (std0 + 1e-6))
    assert norm[3:] == pytest.approx([-1.0, 0.0, 1.0], rel=1e-5)
    data = {"rewards": [0.5, -0.5], "loss_masks": [[1, 1], [1, 0, 1]]}
    compute_advantages_and_returns(defaults_namespace(advantage_estimator="grpo"), data)
    assert data["advantages"] == [[0.5, 0.5], [-0.5, -0.5, -0.5]]
    with pytest.raises(ValueError, match="critic's values"):
        compute_advantages_and_returns(defaults_namespace(advantage_estimator="ppo"), data)


def test_cispo_loss_hand_values_and_gradient():
    # ratio = pi/pi_old: 1.5 (weight clipped to 1 + 0.28), 0.5 (clipped to 1 - 0.2), 1.0, 1.1 (inside)
    log_probs = torch.tensor([-0.5, -1.0, -2.0, -0.2], requires_grad=True)
    ratios = [1.5, 0.5, 1.0, 1.1]
    old = torch.tensor([lp - math.log(r) for lp, r in zip([-0.5, -1.0, -2.0, -0.2], ratios)])
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5])
    loss, clipfrac = compute_cispo_loss(old - log_probs, log_probs, adv, eps_clip=0.2, eps_clip_high=0.28)
    # -w * A * log pi with w = 1.28, 0.8, 1.0, 1.1
    assert loss.tolist() == pytest.approx([0.64, -0.8, 4.0, -0.11], rel=1e-5)
    assert clipfrac.tolist() == [1.0, 1.0, 0.0, 0.0]
    loss.sum().backward()
    # the weight is a constant: d loss / d log pi = -w * A, also where the weight was clipped
    # (PPO's clipped surrogate gives those two tokens no gradient)
    assert log_probs.grad.tolist() == pytest.approx([-1.28, 0.8, -2.0, 0.55], rel=1e-5)


def test_cispo_advantages_are_grpo_returns():
    data = {"rewards": [0.5, -0.5], "loss_masks": [[1, 1], [1, 0, 1]]}
    compute_advantages_and_returns(defaults_namespace(advantage_estimator="cispo"), data)
    assert data["advantages"] == [[0.5, 0.5], [-0.5, -0.5, -0.5]]


def test_value_loss_is_clipped_around_the_rollouts_values():
    values = torch.tensor([1.0, 0.0, 0.5], requires_grad=True)
    old, returns = torch.tensor([0.5, 0.5, 0.5]), torch.tensor([2.0, 0.0, 0.0])
    losses, clipfrac = compute_value_loss(values, old, returns, value_clip=0.2)
    # (V - R)^2 = [1, 0, 0.25]; clipped V = [0.7, 0.3, 0.5] -> [1.69, 0.09, 0.25]; the larger counts
    assert losses.tolist() == pytest.approx([1.69, 0.09, 0.25])
    assert clipfrac.tolist() == [1.0, 1.0, 0.0]
    losses.sum().backward()
    # the two clipped tokens sit on the clamped branch: no gradient; the third: 2 * (0.5 - 0)
    assert values.grad.tolist() == pytest.approx([0.0, 0.0, 1.0])


def test_ppo_advantages_are_gae_over_the_critics_values():
    # token rewards: -kl_coef * kl, the reward added on the last token: [-0.1, 1 - 0.2]
    data = {"rewards": [1.0], "loss_masks": [[1, 1]], "values": [[0.5, 0.25]],
            "log_probs": [[-1.0, -2.0]], "ref_log_probs": [[-1.2, -2.4]]}
    args = defaults_namespace(advantage_estimator="ppo", kl_coef=0.5, kl_loss_type="k1", gamma=1.0, lambd=1.0)
    compute_advantages_and_returns(args, data)
    # gamma = lambd = 1: returns are the reverse sums of the token rewards, advantages returns - values
    assert data["returns"][0] == pytest.approx([0.7, 0.8])
    assert data["advantages"][0] == pytest.approx([0.7 - 0.5, 0.8 - 0.25])
    data["values"] = [[0.5]]
    with pytest.raises(ValueError, match="one per response token"):
        compute_advantages_and_returns(args, data)


def test_ppo_advantages_need_no_log_probs_of_other_dp_ranks():
    """Without a KL reward term (ppo refuses --kl-coef) every DP rank computes every sample's advantages from the
    critic's values alone: a sample of another DP rank carries no log-probs here ([]), and whitening sees the
    whole rollout the same way on every rank."""
    full = {"rewards": [1.0, -1.0], "loss_masks": [[1, 1], [1, 0, 1]], "values": [[0.5, 0.25], [0.1, 0.2, 0.3]],
            "log_probs": [[-1.0, -2.0], [-0.5, -0.5, -0.5]], "ref_log_probs": [[-1.2, -2.4], [-0.4, -0.6, -0.5]]}
    one_rank = {**full, "log_probs": [[-1.0, -2.0], []], "ref_log_probs": [[-1.2, -2.4], []]}
    args = defaults_namespace(advantage_estimator="ppo", kl_loss_type="low_var_kl", normalize_advantages=True)
    for data in (full, one_rank):
        compute_advantages_and_returns(args, data)
    assert one_rank["advantages"] == full["advantages"] and one_rank["returns"] == full["returns"]
    assert full["returns"] == [pytest.approx([1.0, 1.0]), pytest.approx([-1.0, -1.0, -1.0])]
