"""slime/models/prefix_attention.py: a chunk against a longer key prefix as two log-sum-exp-merged kernel calls
equals one lower-right causal call (SDPA's `causal_lower_right`), output and all three gradients, with GQA; the
MATH kernel stands in for flash on CPU (the merge and the backward rule are what is tested here; flash itself is
checked on a GPU by benchmarks/bench_step_gpu.py attention against the masked path)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from slime.models import cp_attention
from slime.models.prefix_attention import MATH, prefix_attention


def _reference(q, k, v, scale):
    first = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(first(q), first(k), first(v), scale=scale,
                                         attn_mask=causal_lower_right(q.shape[0], k.shape[0]))
    return out.squeeze(0).transpose(0, 1)


def _inputs(tq, tk, hq, hkv, d, seed):
    gen = torch.Generator().manual_seed(seed)
    make = lambda t, h: torch.randn(t, h, d, dtype=torch.float64, generator=gen).requires_grad_(True)  # noqa: E731
    return make(tq, hq), make(tk, hkv), make(tk, hkv), torch.randn(tq, hq, d, dtype=torch.float64, generator=gen)


def _forward_backward(fn, q, k, v, grad):
    for x in (q, k, v):
        x.grad = None
    out = fn(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()


@pytest.mark.parametrize("tq,tk,hq,hkv", [(8, 32, 4, 2), (5, 6, 2, 2), (16, 48, 4, 1)])
def test_merged_parts_equal_one_lower_right_call(tq, tk, hq, hkv):
    q, k, v, grad = _inputs(tq, tk, hq, hkv, 8, seed=tq + tk)
    scale = 0.3
    got = _forward_backward(lambda *x: prefix_attention(*x, scale=scale, kernel=MATH), q, k, v, grad)
    want = _forward_backward(lambda *x: _reference(*x, scale), q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), (name, (a - b).abs().max().item())


def test_split_kernel_falls_back_where_flash_does_not_serve():
    """On CPU the "split" kernel is the "causal" one, bit for bit (flash serves CUDA fp16/bf16 only)."""
    q, k, v, _ = _inputs(16, 32, 4, 2, 8, seed=1)
    plan = cp_attention.attention_plan((32,), 2, 0, torch.device("cpu"))
    split = cp_attention.attend_split(q, k, v, plan, scale=0.5, dropout_p=0.0)
    assert torch.equal(split, cp_attention.attend_causal(q, k, v, plan, scale=0.5, dropout_p=0.0))


def test_a_prefix_no_longer_than_the_queries_is_refused():
    q, k, v, _ = _inputs(8, 8, 2, 2, 8, seed=2)
    with pytest.raises(ValueError, match="longer than the queries"):
        prefix_attention(q, k, v, scale=1.0, kernel=MATH)
