"""torch's fused AdamW in megatron's optimizer (slime/backends/megatron_utils/adam_kernel.py): the same update as
torch's default kernel through switches and a reload of a default-kernel state, and grad clipping's multi-tensor
norm and scale (slime/patches/megatron_core.py) giving the per-tensor values."""

from __future__ import annotations

import pytest
import torch

from slime.backends.megatron_utils.adam_kernel import adam_kernel_in_use, fused_adam_chosen, use_fused_adam

SHAPES = [(7, 5), (16,), (3, 4, 2), (1,)]


def _adamw(params):
    # as megatron-core builds it without TransformerEngine or Apex (decoupled weight decay)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def _steps(optimizer, params, grads):
    for g_step in grads:
        for p, g in zip(params, g_step):
            p.grad = g.clone()
        optimizer.step()


def _counting_fused_kernel(monkeypatch):
    from torch.optim import adam

    calls = []
    original = adam._fused_adam

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(adam, "_fused_adam", counted)
    return calls


def test_fused_adamw_is_the_default_kernels_update_through_switches_and_a_reload(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(6)]
    ref = [p.clone().requires_grad_() for p in start]
    reference = _adamw(ref)
    _steps(reference, ref, grads)

    calls = _counting_fused_kernel(monkeypatch)
    got = [p.clone().requires_grad_() for p in start]
    optimizer = _adamw(got)
    _steps(optimizer, got, grads[:1])  # default kernel: state with host-side steps
    assert not calls and adam_kernel_in_use(optimizer) == "default"
    assert use_fused_adam(optimizer, True) == 1 and adam_kernel_in_use(optimizer) == "fused"
    _steps(optimizer, got, grads[1:3])
    assert len(calls) == 2

    # a state saved by the default kernel (groups without `fused`), its step one tensor shared by all parameters,
    # as megatron's distributed optimizer loads it: the fused kernel comes back, with a step per parameter
    saved = optimizer.state_dict()
    shared_step = torch.tensor(3.0)
    for group in saved["param_groups"]:
        group["fused"], group["foreach"] = None, None
    for state in saved["state"].values():
        state["step"] = shared_step
    optimizer.load_state_dict(saved)
    steps = [optimizer.state[p]["step"] for p in got]
    assert adam_kernel_in_use(optimizer) == "fused" and len({id(s) for s in steps}) == len(got)
    assert all(s.dtype == torch.float32 and float(s) == 3.0 for s in steps)
    _steps(optimizer, got, grads[3:5])
    assert len(calls) == 4

    use_fused_adam(optimizer, False)  # and back: torch's default kernel on the same state
    _steps(optimizer, got, grads[5:])
    assert len(calls) == 4 and adam_kernel_in_use(optimizer) == "default"
    assert all(optimizer.state[p]["step"].device.type == "cpu" for p in got)
    for a, b, p0 in zip(got, ref, start):
        assert (b - p0).abs().max() > 1e-3  # the steps moved the weights
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fused_adam_is_chosen_on_gpus_and_refuses_integer_parameters():
    assert fused_adam_chosen(torch.device("cuda", 0)) and not fused_adam_chosen(torch.device("cpu"))
    optimizer = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=1.0)
    assert use_fused_adam(optimizer, True) == 0  # not an Adam: left alone
    adam = _adamw([torch.zeros(2, requires_grad=True)])
    adam.param_groups[0]["params"].append(torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="floating-point"):
        use_fused_adam(adam, True)


def test_grad_clipping_multi_tensor_norm_and_scale_give_the_per_tensor_values():
    from megatron.core import utils

    from slime.patches import megatron_core

    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=gen) for s in SHAPES] + [torch.randn(5, generator=gen).bfloat16()]
    per_tensor, _ = megatron_core._l2_norm_per_tensor(0, None, [grads], False)
    multi, _ = megatron_core._l2_norm_without_host_sync(0, None, [grads], False)
    assert torch.equal(per_tensor, multi) and float(multi) > 0
    grads = grads[:-1]  # megatron clips fp32 (main) gradients only
    expected = [g.clone() for g in grads]
    utils.local_multi_tensor_scale(0, None, [expected, expected], 0.37)
    in_place = [g.clone() for g in grads]
    megatron_core._scale_without_a_copy(0, None, [in_place, in_place], 0.37)
    copied = [torch.empty_like(g) for g in grads]
    megatron_core._scale_without_a_copy(0, None, [grads, copied], 0.37)
    for want, a, b, g in zip(expected, in_place, copied, grads):
        assert torch.equal(a, want) and torch.equal(b, want) and not torch.equal(want, g)
