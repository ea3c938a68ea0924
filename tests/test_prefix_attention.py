"""slime/models/prefix_attention.py: a chunk against a longer key prefix as two log-sum-exp-merged kernel calls
equals one lower-right causal call (SDPA's `causal_lower_right`), output and all three gradients, with GQA; the
MATH kernel stands in for flash on CPU (the merge and the backward rule are what is tested here; flash itself is
checked on a GPU by benchmarks/bench_step_gpu.py attention against the masked path). A CP rank's two chunks of a
sequence with their causal squares batched (chunk_pair_attention, attend_causal's default) equal the masked
path and the three-call split, for every CP size and rank, packed sequences and GQA, in as many kernel calls as
planned."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from slime.models import cp_attention, prefix_attention as pa
from slime.models.prefix_attention import MATH, chunk_pair_attention, prefix_attention


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


def _grouped_math() -> pa.LseKernel:
    """MATH taking fewer k/v heads than q heads itself, as cuDNN does (the k/v views reach it unrepeated)."""
    def forward(q, k, v, causal, scale):
        groups = q.shape[1] // k.shape[1]
        return MATH.forward(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), causal, scale)

    def backward(grad, q, k, v, out, lse, causal, scale, state):
        groups = q.shape[1] // k.shape[1]
        dq, dk, dv = MATH.backward(grad, q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), out, lse,
                                   causal, scale, state)
        fold = lambda x: x.unflatten(1, (k.shape[1], groups)).sum(2)  # noqa: E731
        return dq, fold(dk), fold(dv)

    return pa.LseKernel("grouped-math", forward, backward, grouped_kv=True)


def _counting(kernel: pa.LseKernel, calls: list) -> pa.LseKernel:
    """kernel, noting (direction, causal, batch, queries, keys) of every call."""
    def forward(q, k, *rest):
        calls.append(("fwd", rest[1], q.shape[0], q.shape[2], k.shape[2]))
        return kernel.forward(q, k, *rest)

    def backward(grad, q, k, *rest):
        calls.append(("bwd", rest[3], q.shape[0], q.shape[2], k.shape[2]))
        return kernel.backward(grad, q, k, *rest)

    return dataclasses.replace(kernel, forward=forward, backward=backward)


def _cp_rank_inputs(lens, cp, hq, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    make = lambda t, h: torch.randn(t, h, d, dtype=dtype, generator=gen).requires_grad_(True)  # noqa: E731
    local = sum(lens) // cp
    return make(local, hq), make(sum(lens), hkv), make(sum(lens), hkv), torch.randn(local, hq, d, dtype=dtype,
                                                                                      generator=gen)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("groups,head_dim,dtype", [(1, 8, torch.float64), (2, 8, torch.float64),
                                                   (2, 4, torch.float64), (2, 8, torch.float32)],
                         ids=["mha", "gqa", "gqa-d4", "gqa-fp32"])
def test_batched_chunks_equal_the_masked_path_and_the_three_call_split(cp, groups, head_dim, dtype):
    """Every rank of a packed batch of three sequences of different lengths: output and q/k/v gradients of the
    batched split equal the masked path's (fp rounding) and the three-call split's (a few ulps). Head dim 8 reads the
    chunks' own keys as one strided view, 4 (rows not 16-byte aligned) as a copy; fp32 as the GPU's lse."""
    lens = tuple(n * 2 * cp for n in (3, 1, 2))
    tol = {torch.float64: (1e-12, 1e-13), torch.float32: (1e-5, 1e-6)}[dtype]
    for rank in range(cp):
        plan = cp_attention.attention_plan(lens, cp, rank, torch.device("cpu"))
        q, k, v, grad = _cp_rank_inputs(lens, cp, 4, 4 // groups, head_dim, dtype, seed=10 * cp + rank)
        attend = lambda batched, kernel=MATH: lambda *x: cp_attention.attend_causal(  # noqa: E731
            *x, plan, scale=0.4, dropout_p=0.0, split=True, lse_kernel=kernel, batched=batched)
        got = _forward_backward(attend(True), q, k, v, grad)
        grouped = _forward_backward(attend(True, _grouped_math()), q, k, v, grad)
        three = _forward_backward(attend(False), q, k, v, grad)
        masked = _forward_backward(lambda *x: cp_attention.attend_masked(*x, plan, scale=0.4, dropout_p=0.0),
                                   q, k, v, grad)
        for name, a, g, t, m in zip(("out", "dq", "dk", "dv"), got, grouped, three, masked):
            where = f"cp{cp} rank {rank} {name}"
            torch.testing.assert_close(a, m, rtol=tol[0] * 10, atol=tol[0] * 10, msg=lambda e: f"{where}: {e}")
            torch.testing.assert_close(a, t, rtol=tol[1], atol=tol[1], msg=lambda e: f"{where} vs 3 calls: {e}")
            torch.testing.assert_close(g, a, rtol=tol[1], atol=tol[1], msg=lambda e: f"{where} grouped kv: {e}")


@pytest.mark.parametrize("cp,rank", [(2, 0), (2, 1), (4, 0), (4, 2)])
def test_batched_chunks_are_one_causal_call_and_a_call_per_past(cp, rank):
    """Per sequence, each way: one causal call over both chunks (batch 2, half queries, half keys) and one unmasked
    call per chunk with keys before it (the first chunk only on ranks > 0), GQA heads unrepeated."""
    lens = (8 * cp, 4 * cp)
    calls = []
    plan = cp_attention.attention_plan(lens, cp, rank, torch.device("cpu"))
    q, k, v, grad = _cp_rank_inputs(lens, cp, 4, 2, 8, torch.float64, seed=rank)
    out = cp_attention.attend_causal(q, k, v, plan, scale=0.4, dropout_p=0.0, split=True, batched=True,
                                     lse_kernel=_counting(_grouped_math(), calls))
    out.backward(grad)
    expected = []  # (causal, batch, queries, keys) per call
    for n in lens:
        half = n // (2 * cp)
        pasts = (rank * half, (2 * cp - 1 - rank) * half)  # keys before each chunk
        expected += [(True, 2, half, half)] + [(False, 1, half, past) for past in pasts if past]
    assert [c[1:] for c in calls if c[0] == "fwd"] == expected
    assert sorted(c[1:] for c in calls if c[0] == "bwd") == sorted(expected)


def test_chunks_own_keys_are_a_view_where_a_kernel_reads_it():
    x = torch.randn(40, 2, 8)
    own = pa._own_keys(x, first_end=12, half=4)
    assert own.data_ptr() == x[8].data_ptr() and own.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert torch.equal(own, torch.stack([x[8:12], x[36:40]]).transpose(1, 2))
    odd = torch.randn(40, 2, 4)  # rows of 8 elements, heads 4 apart: not 16-byte aligned for bf16, so copied
    own = pa._own_keys(odd, first_end=12, half=4)
    assert own.is_contiguous() and torch.equal(own, torch.stack([odd[8:12], odd[36:40]]).transpose(1, 2))


def test_chunk_pair_refuses_overlapping_or_uneven_chunks():
    q, k, v, _ = _inputs(8, 16, 2, 2, 8, seed=3)
    with pytest.raises(ValueError, match="two chunks of equal length"):
        chunk_pair_attention(q, k, v, 14, scale=1.0, kernel=MATH)  # the first chunk's keys reach into the second's
    with pytest.raises(ValueError, match="two chunks of equal length"):
        chunk_pair_attention(q[:7], k, v, 4, scale=1.0, kernel=MATH)


def test_dropout_keeps_the_unsplit_path():
    """The lse kernels run without dropout: with it, even a requested split is SDPA's own calls."""
    calls = []
    plan = cp_attention.attention_plan((16,), 2, 0, torch.device("cpu"))
    q, k, v, _ = _cp_rank_inputs((16,), 2, 4, 2, 8, torch.float64, seed=4)
    out = cp_attention.attend_causal(q, k, v, plan, scale=0.4, dropout_p=0.1, split=True, batched=True,
                                     lse_kernel=_counting(MATH, calls))
    assert out.shape == q.shape and calls == []
