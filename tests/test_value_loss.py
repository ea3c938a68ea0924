"""The critic's clipped value loss on one packed micro-batch (single process), worked out per sample by hand."""
from __future__ import annotations

import functools

import pytest
import torch

from train_step_harness import loss_args
from slime.backends.megatron_utils.data import pack_micro_batch, plans_from_rollout
from slime.backends.megatron_utils.value_loss import value_micro_batch_loss
from slime.config.loss import build_value_loss_config


def _data():
    return {
        "tokens": [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10], [3, 3, 4, 5, 9]],
        "response_lengths": [3, 2, 4],
        "loss_masks": [[1, 1, 1], [1, 1], [1, 0, 1, 1]],
        "values": [[0.1, 0.2, 0.3], [-0.5, 0.0], [1.0, 1.0, 0.2, -0.2]],
        "returns": [[1.0, 1.0, 1.0], [-1.0, -1.0], [0.5, 0.5, 0.5, 0.5]],
    }


_args = functools.partial(loss_args, advantage_estimator="ppo")


def _expected(data, packed, output, value_clip, per_token):
    """Sum over samples of the masked clipped loss: per-sample means / samples, or / all loss tokens."""
    flat, total, offset = output.detach().reshape(-1), 0.0, 0
    tokens = sum(sum(m) for m in data["loss_masks"])
    for sid, padded in zip(packed.sample_ids, packed.padded_lengths):
        prompt = len(data["tokens"][sid]) - data["response_lengths"][sid]
        mask = data["loss_masks"][sid]
        sample = 0.0
        for j, (m, old, ret) in enumerate(zip(mask, data["values"][sid], data["returns"][sid])):
            v = flat[offset + prompt - 1 + j].item()  # the position before response token j
            clipped = old + min(max(v - old, -value_clip), value_clip)
            sample += m * max((v - ret) ** 2, (clipped - ret) ** 2)
        total += sample / tokens if per_token else sample / sum(mask) / 3
        offset += padded
    return total


@pytest.mark.parametrize("per_token", [False, True], ids=["sample_mean", "per_token"])
def test_value_loss_of_a_packed_micro_batch_matches_the_hand_sum(per_token):
    data, args = _data(), _args(calculate_per_token_loss=per_token)
    plan = plans_from_rollout(data, args, dp_size=1, dp_rank=0)[0]
    packed = pack_micro_batch(data, plan.micro_batches[0], cp_size=1, cp_rank=0, tp_size=1, sequence_parallel=False)
    output = torch.randn(1, packed.labels.numel(), 1, generator=torch.Generator().manual_seed(2), requires_grad=True)
    loss, metrics = value_micro_batch_loss(output, packed, plan, build_value_loss_config(args))
    assert len(plan.micro_batches) == 1 and len(packed.sample_ids) == 3
    assert loss.item() == pytest.approx(_expected(data, packed, output, 0.2, per_token), rel=1e-5)
    assert metrics["value_loss"].item() == pytest.approx(loss.item())
    assert 0.0 < metrics["value_clipfrac"].item() <= 1.0  # random values move far from the rollout's
    loss.backward()
    assert output.grad[0, :, 0][packed.loss_mask == 0].abs().sum() == 0  # prompt, masked and padding positions


def test_the_critic_refuses_a_batch_without_values():
    data, args = _data(), _args()
    del data["values"]
    plan = plans_from_rollout(data, args, dp_size=1, dp_rank=0)[0]
    packed = pack_micro_batch(data, plan.micro_batches[0], cp_size=1, cp_rank=0, tp_size=1, sequence_parallel=False)
    with pytest.raises(ValueError, match="'values' and 'returns'"):
        value_micro_batch_loss(torch.zeros(1, packed.labels.numel(), 1), packed, plan, build_value_loss_config(args))
