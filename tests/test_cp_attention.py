"""ContextParallelAttention: zig-zag positions; the mask-free "causal" kernels against the dense-mask
path they replace and a plain softmax reference (fp32, forward and gradients, packed, unpacked and
CP zig-zag chunks); lengths read without touching cu_seqlens; CP4 forward + backward over gloo."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from host_reads import HostReadForbidden
from mp_utils import run_ranks

pytestmark = pytest.mark.ranks

HEADS, GROUPS, DIM = 4, 2, 8
SEQ_LENS = (16, 32, 8)  # padded lengths, divisible by 2*cp for cp=4


def _config(cp: int):
    from slime import patches

    patches.apply_all()
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                             num_query_groups=GROUPS, kv_channels=DIM, context_parallel_size=cp,
                             attention_dropout=0.0, use_cpu_initialization=True)


def _attention(cp: int, group=None, kernel: str = "causal"):
    from megatron.core.transformer.enums import AttnMaskType

    from slime_plugins.models.cp_attention import ContextParallelAttention

    pg = types.SimpleNamespace(cp=group) if group is not None else None
    attention = ContextParallelAttention(_config(cp), 1, AttnMaskType.causal, "self", pg_collection=pg)
    attention.kernel = kernel
    return attention


def _packed_params(seq_lens, cu=None):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor((0,) + tuple(seq_lens)).cumsum(0).to(torch.int32) if cu is None else cu
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(seq_lens), max_seqlen_kv=max(seq_lens))


def _reference(q, k, v, seq_lens):
    """Plain causal softmax attention per sequence, GQA by head // (HEADS // GROUPS)."""
    outs, start = [], 0
    for n in seq_lens:
        qs, ks, vs = q[start:start + n], k[start:start + n], v[start:start + n]
        kv_head = torch.arange(HEADS) // (HEADS // GROUPS)
        scores = torch.einsum("qhd,khd->hqk", qs, ks[:, kv_head]) / DIM ** 0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs[:, kv_head]))
        start += n
    return torch.cat(outs).reshape(sum(seq_lens), HEADS * DIM)


def _inputs(seq_lens=SEQ_LENS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    q = torch.randn(total, HEADS, DIM, generator=gen)
    k = torch.randn(total, GROUPS, DIM, generator=gen)
    v = torch.randn(total, GROUPS, DIM, generator=gen)
    grad_out = torch.randn(total, HEADS * DIM, generator=gen)
    return q, k, v, grad_out


def _zigzag_index(seq_lens, cp, rank):
    """Indices into the packed full batch of the tokens CP rank `rank` holds, in local order."""
    from slime_plugins.models.cp_attention import zigzag_positions

    starts = torch.tensor((0,) + tuple(seq_lens[:-1])).cumsum(0)
    return torch.cat([s + zigzag_positions(n, cp, rank) for s, n in zip(starts.tolist(), seq_lens)])


def _leaves(*tensors):
    return [t.clone().requires_grad_(True) for t in tensors]


def _forward_backward(fn, q, k, v, grad_out):
    """fn's output and the grads of q, k, v for a fixed output gradient."""
    q, k, v = _leaves(q, k, v)
    out = fn(q, k, v)
    out.backward(grad_out)
    return out.detach(), [x.grad for x in (q, k, v)]


def test_zigzag_positions_cover_each_sequence_once():
    from slime_plugins.models.cp_attention import zigzag_positions

    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    allpos = torch.cat([zigzag_positions(24, 3, r) for r in range(3)])
    assert sorted(allpos.tolist()) == list(range(24))
    with pytest.raises(ValueError):
        zigzag_positions(10, 2, 0)


@pytest.mark.parametrize("kernel", ["causal", "masked"])
def test_packed_and_unpacked_match_reference_without_cp(kernel):
    lens = (16, 29, 7)  # odd lengths: CP1 has no zig-zag split
    q, k, v, grad_out = _inputs(lens)
    attention = _attention(cp=1, kernel=kernel)
    out, grads = _forward_backward(lambda *x: attention(*x, None, packed_seq_params=_packed_params(lens)),
                                   q, k, v, grad_out)
    ref_out, ref_grads = _forward_backward(lambda *x: _reference(*x, lens), q, k, v, grad_out)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # [s, b, h, d]: two sequences of 16 as a batch
    qb, kb, vb = (x[:32].reshape(2, 16, *x.shape[1:]).transpose(0, 1) for x in (q, k, v))
    unpacked = attention(qb, kb, vb, None)
    expected = _reference(q[:32], k[:32], v[:32], (16, 16)).reshape(2, 16, -1).transpose(0, 1)
    torch.testing.assert_close(unpacked, expected, rtol=0, atol=1e-5)


def test_lower_right_chunk_equals_its_explicit_mask():
    """A query chunk against a longer key prefix: query i sees keys <= i + tk - tq; GQA unrepeated."""
    from slime_plugins.models.cp_attention import causal_chunk_attention, masked_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(6, HEADS, DIM, generator=gen), *torch.randn(2, 20, GROUPS, DIM, generator=gen)
    got = causal_chunk_attention(q, k, v, scale=0.3, dropout_p=0.0)
    want = masked_attention(q, k, v, torch.arange(14, 20), torch.arange(20), scale=0.3, dropout_p=0.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_the_cpu_lower_right_mask_gives_causal_bias_s_results_bit_for_bit():
    """On CPU the chunk kernel passes the boolean mask itself: the same outputs and gradients, to the bit, as torch's
    CausalBias (which materialises that mask there), so no CPU run's numbers moved."""
    from torch.nn.attention.bias import causal_lower_right

    from slime_plugins.models.cp_attention import causal_chunk_attention, heads_first, lower_right_mask

    assert torch.equal(lower_right_mask(6, 20, torch.device("cpu")), causal_lower_right(6, 20)._materialize())
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(6, HEADS, DIM, generator=gen), *torch.randn(2, 20, GROUPS, DIM, generator=gen)]
    results = []
    for bias in (True, False):
        q, k, v = (x.clone().requires_grad_() for x in inputs)
        if bias:
            out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v),
                                                 attn_mask=causal_lower_right(6, 20), scale=0.3,
                                                 enable_gqa=True).squeeze(0).transpose(0, 1)
        else:
            out = causal_chunk_attention(q, k, v, scale=0.3, dropout_p=0.0)
        out.pow(2).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _simulated_cp(kernel: str, seq_lens, cp: int):
    """Every CP rank's kernel call in one process: the gathered K/V are the ranks' local K/V
    concatenated rank-major (what the all-gather returns), so the grads of the full q/k/v
    sum over ranks exactly as the reduce-scatter does."""
    from slime_plugins.models import cp_attention

    kernel_fn = {"causal": cp_attention.attend_causal, "masked": cp_attention.attend_masked}[kernel]
    index = [_zigzag_index(seq_lens, cp, rank) for rank in range(cp)]
    gathered = torch.cat(index)

    def run(q, k, v):
        out = torch.zeros(q.shape[0], HEADS * DIM, dtype=q.dtype)
        for rank in range(cp):
            plan = cp_attention.attention_plan(tuple(seq_lens), cp, rank, q.device)
            local = kernel_fn(q[index[rank]], k[gathered], v[gathered], plan, scale=DIM ** -0.5, dropout_p=0.0)
            out = out.index_put((index[rank],), local.reshape(local.shape[0], -1))
        return out

    return run


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_chunks_causal_kernel_matches_masked_and_reference(cp):
    lens = tuple(n * 2 * cp for n in (2, 5, 1))
    q, k, v, grad_out = _inputs(lens, seed=cp)
    ref_out, ref_grads = _forward_backward(lambda *x: _reference(*x, lens), q, k, v, grad_out)
    for kernel in ("causal", "masked"):
        out, grads = _forward_backward(_simulated_cp(kernel, lens, cp), q, k, v, grad_out)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5, msg=lambda m: f"{kernel}: {m}")
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{kernel} grad: {m}")


def _varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash-attn's documented varlen contract (segments of cu_q / cu_k; causal aligned
    bottom-right; GQA by head // groups), written plainly."""
    assert causal and dropout_p == 0.0 and cu_q.dtype == cu_k.dtype == torch.int32
    outs = []
    for i in range(cu_q.numel() - 1):
        qs, ks, vs = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        assert qs.shape[0] <= max_q and ks.shape[0] <= max_k
        kv_head = torch.arange(q.shape[1]) // (q.shape[1] // k.shape[1])
        scores = torch.einsum("qhd,khd->hqk", qs, ks[:, kv_head]) * softmax_scale
        future = torch.ones(qs.shape[0], ks.shape[0], dtype=torch.bool).triu(1 + ks.shape[0] - qs.shape[0])
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(future, float("-inf")).softmax(-1),
                                 vs[:, kv_head]))
    return torch.cat(outs)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_flash_varlen_layout_matches_reference(cp, monkeypatch):
    """The cu_seqlens and key prefixes handed to flash-attn's varlen kernel (not installed here:
    its contract is played by _varlen_reference, so this checks our layout, not flash-attn)."""
    from slime_plugins.models import cp_attention

    monkeypatch.setattr(cp_attention, "flash_attn_varlen_func", _varlen_reference)
    monkeypatch.setattr(cp_attention, "attend_causal", cp_attention.attend_flash_varlen)
    lens = tuple(n * 2 * cp for n in (3, 1, 4))
    q, k, v, grad_out = _inputs(lens, seed=10 + cp)
    ref_out, ref_grads = _forward_backward(lambda *x: _reference(*x, lens), q, k, v, grad_out)
    out, grads = _forward_backward(_simulated_cp("causal", lens, cp), q, k, v, grad_out)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_lengths_come_from_the_host_not_from_cu_seqlens():
    from slime_plugins.models.cp_attention import packed_seq_params

    q, k, v, _ = _inputs()
    cu = torch.tensor((0,) + SEQ_LENS).cumsum(0).to(torch.int32).as_subclass(HostReadForbidden)
    attention = _attention(cp=1)
    out = attention(q, k, v, None, packed_seq_params=packed_seq_params(cu, SEQ_LENS))
    torch.testing.assert_close(out, _reference(q, k, v, SEQ_LENS), rtol=0, atol=1e-5)
    with pytest.raises(AssertionError, match="host read"):  # megatron's own params: read back (a sync on GPU)
        attention(q, k, v, None, packed_seq_params=_packed_params(SEQ_LENS, cu))


def _cp_rank_forward_backward(rank, world):
    import torch.distributed as dist

    q, k, v, grad_out = _inputs()
    index = _zigzag_index(SEQ_LENS, world, rank)
    results = {}
    for kernel in ("causal", "masked"):
        attention = _attention(cp=world, group=dist.group.WORLD, kernel=kernel)
        results[kernel] = _forward_backward(
            lambda *x: attention(*x, None, packed_seq_params=_packed_params(SEQ_LENS)),
            q[index], k[index], v[index], grad_out[index])
    return index, results


@pytest.mark.timeout(120)
def test_cp4_forward_and_backward_match_single_process():
    results = run_ranks(_cp_rank_forward_backward, 4, timeout_s=110)
    q, k, v, grad_out = _inputs()
    ref_out, ref_grads = _forward_backward(lambda *x: _reference(*x, SEQ_LENS), q, k, v, grad_out)
    for kernel in ("causal", "masked"):
        out = torch.zeros_like(ref_out)
        grads = [torch.zeros_like(x) for x in (q, k, v)]
        for index, by_kernel in results:
            local_out, local_grads = by_kernel[kernel]
            out[index] = local_out
            for full, part in zip(grads, local_grads):
                full[index] = part
        torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-5)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
