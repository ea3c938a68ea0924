"""fla with the project's chunk_bwd_dqkwg (slime/models/fla_backend.py): what the backend takes, the first-use
agreement check, and the dispatcher's fallback to the compiled rule when the check fails (CPU; fla's Triton
kernels need a GPU, so fla's rule is stood in for by the project's rule, intact or with a broken gradient)."""
from __future__ import annotations

import logging

import pytest
import torch

from slime.models import fla_backend
from slime.models import gated_delta_rule as gdr

SHAPE = dict(key_heads=2, value_heads=4, dim_k=8, dim_v=8, chunk_size=16, device=torch.device("cpu"), tokens=40)
FP32 = (torch.float32,) * 4


def test_backend_takes_the_gated_delta_rule_call_only():
    q = torch.zeros(1, 8, 2, 4)
    v, w, g = torch.zeros(1, 8, 4, 4), torch.zeros(1, 8, 4, 4), torch.zeros(1, 8, 4)
    assert fla_backend.unsupported_reason(q, q, v, w, g, None, v) is None
    assert "no per-token gate" in fla_backend.unsupported_reason(q, q, v, w, None, None, v)
    assert "g_gamma" in fla_backend.unsupported_reason(q, q, v, w, g, torch.zeros(4), v)
    assert "w and dv" in fla_backend.unsupported_reason(q, q, v, None, g, None, None)
    assert "not a multiple" in fla_backend.unsupported_reason(q, q, torch.zeros(1, 8, 3, 4), w, g, None, v)


def _half_dq_rule(q, k, *rest, **kw):
    """The project's rule with dq halved and everything else intact (the kind of error a miscompile makes)."""
    return gdr.chunk_gated_delta_rule(0.5 * q + 0.5 * q.detach(), k, *rest, **kw)


def test_agreement_passes_the_same_maths_and_names_a_wrong_gradient():
    same = fla_backend.agreement(gdr.chunk_gated_delta_rule, gdr.chunk_gated_delta_rule, dtypes=FP32, **SHAPE)
    assert same.passed and set(same.errors) == {"out", "final_state", "dq", "dk", "dv", "dg", "dbeta",
                                                "dinitial_state"}
    assert max(same.errors.values()) < 1e-6
    broken = fla_backend.agreement(_half_dq_rule, gdr.chunk_gated_delta_rule, dtypes=FP32, **SHAPE)
    assert not broken.passed
    assert broken.errors["out"] < 1e-6 and broken.errors["dq"] > 0.3  # the forward alone would not show it
    assert "(dq;" in broken.describe()


@pytest.fixture
def fla_dqkwg_chosen(monkeypatch):
    """The dispatcher as on Hopper with Triton 3.6 and fla present, on CPU tensors with stand-ins for fla."""
    monkeypatch.setattr(gdr, "active_kernel", lambda device: gdr.KernelChoice("fla-dqkwg", "test"))
    monkeypatch.setattr(fla_backend, "install", lambda: None)
    calls = []

    def fake_fla(*args, **kw):
        calls.append(fla_backend.enabled())
        return gdr.recurrent_gated_delta_rule(*args, **kw)

    monkeypatch.setattr(gdr, "_fla_rule", fake_fla)
    gdr._fla_dqkwg_refusal.cache_clear()
    yield calls
    gdr._fla_dqkwg_refusal.cache_clear()
    fla_backend.set_enabled(False)


def _call():
    gen = torch.Generator().manual_seed(0)
    q = gdr.l2norm(torch.randn(1, 20, 1, 8, generator=gen))
    v = torch.randn(1, 20, 2, 8, generator=gen)
    g, beta = -torch.rand(1, 20, 2, generator=gen), torch.rand(1, 20, 2, generator=gen)
    return gdr.chunk_gated_delta_rule(q, q, v, g, beta, cu_seqlens=torch.tensor([0, 7, 20]))[0]


def test_fla_dqkwg_runs_fla_with_the_backend_on_once_it_agrees(fla_dqkwg_chosen, monkeypatch):
    checks = []
    monkeypatch.setattr(fla_backend, "agreement",
                        lambda *a, **kw: checks.append(kw) or fla_backend.Agreement({"dq": 0.0}, 0.1))
    _call()
    _call()
    assert fla_dqkwg_chosen == [True, True]  # fla ran, with the project's chunk_bwd_dqkwg switched on
    assert len(checks) == 1 and checks[0]["key_heads"] == 1 and checks[0]["value_heads"] == 2


def test_fla_dqkwg_falls_back_to_the_rule_when_the_check_fails(fla_dqkwg_chosen, monkeypatch, caplog):
    monkeypatch.setattr(fla_backend, "agreement", lambda *a, **kw: fla_backend.Agreement({"dq": 0.5}, 0.1))
    with caplog.at_level(logging.WARNING, logger=gdr.__name__):
        out = _call()
    assert fla_dqkwg_chosen == []  # fla never ran
    assert "disagrees with the project's rule" in caplog.text and "compiled rule runs instead" in caplog.text
    assert out.shape == (1, 20, 2, 8) and torch.isfinite(out).all()  # the eager rule's output (CPU)

    def raising(*a, **kw):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results")

    gdr._fla_dqkwg_refusal.cache_clear()
    monkeypatch.setattr(fla_backend, "agreement", raising)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=gdr.__name__):
        _call()
    assert fla_dqkwg_chosen == [] and "failed its first-use check (RuntimeError: Triton >= 3.4.0" in caplog.text


def test_forcing_fla_switches_the_backend_off(monkeypatch):
    monkeypatch.setattr(gdr, "active_kernel", lambda device: gdr.KernelChoice("fla", "test"))
    seen = []
    monkeypatch.setattr(gdr, "_fla_rule", lambda *a, **kw: seen.append(fla_backend.enabled()) or (a[2], None))
    fla_backend.set_enabled(True)
    _call()
    assert seen == [False]
