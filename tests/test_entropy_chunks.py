"""The entropy metric (no gradient) over token chunks equals the one-pass entropy, and the shape check stays."""
from __future__ import annotations

import types

import pytest
import torch

from slime.algorithms.policy_loss import ppo_clip_loss
from slime.backends.megatron_utils import loss as loss_mod
from slime.config.loss import LossConfig


def _cfg(temperature: float, entropy_coef: float = 0.0):
    return LossConfig(calculate_per_token_loss=True, eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None,
                      use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", entropy_coef=entropy_coef,
                      use_tis=False, tis_clip=2.0, tis_clip_low=0.0, temperature=temperature, policy_loss=ppo_clip_loss)


def test_chunked_entropy_equals_one_pass(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(1, 37, 50, generator=gen)).to(torch.bfloat16).requires_grad_(True)
    packed = types.SimpleNamespace(labels=torch.zeros(37, dtype=torch.long))
    one_pass = loss_mod.token_entropy(logits, packed, _cfg(0.7, entropy_coef=1.0), None)  # the unchunked branch
    monkeypatch.setattr(loss_mod, "ENTROPY_CHUNK_ELEMENTS", 8 * 50)  # 5 chunks of 8 rows (the last of 5)
    chunked = loss_mod.token_entropy(logits, packed, _cfg(0.7), None)
    assert chunked.shape == (37,) and not chunked.requires_grad
    torch.testing.assert_close(chunked, one_pass.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="positions"):
        loss_mod.token_entropy(logits, types.SimpleNamespace(labels=torch.zeros(36)), _cfg(0.7), None)
