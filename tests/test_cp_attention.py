"""ContextParallelAttention: zig-zag positions, packed/unpacked causal GQA, and CP4 forward +
backward equal to single-process attention."""

from __future__ import annotations

import types

import pytest
import torch

from mp_utils import run_ranks

HEADS, GROUPS, DIM = 4, 2, 8
SEQ_LENS = (16, 32, 8)  # padded lengths, divisible by 2*cp for cp=4


def _config(cp: int):
    import patches

    patches.apply_all()
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                             num_query_groups=GROUPS, kv_channels=DIM, context_parallel_size=cp,
                             attention_dropout=0.0, use_cpu_initialization=True)


def _attention(cp: int, group=None):
    from megatron.core.transformer.enums import AttnMaskType

    from slime_plugins.models.cp_attention import ContextParallelAttention

    pg = types.SimpleNamespace(cp=group) if group is not None else None
    return ContextParallelAttention(_config(cp), 1, AttnMaskType.causal, "self", pg_collection=pg)


def _packed_params(seq_lens):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor((0,) + tuple(seq_lens)).cumsum(0).to(torch.int32)
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


def _inputs():
    gen = torch.Generator().manual_seed(0)
    total = sum(SEQ_LENS)
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


def test_zigzag_positions_cover_each_sequence_once():
    from slime_plugins.models.cp_attention import zigzag_positions

    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    allpos = torch.cat([zigzag_positions(24, 3, r) for r in range(3)])
    assert sorted(allpos.tolist()) == list(range(24))
    with pytest.raises(ValueError):
        zigzag_positions(10, 2, 0)


def test_packed_and_unpacked_match_reference_without_cp():
    q, k, v, _ = _inputs()
    attention = _attention(cp=1)
    packed = attention(q, k, v, None, packed_seq_params=_packed_params(SEQ_LENS))
    torch.testing.assert_close(packed, _reference(q, k, v, SEQ_LENS), rtol=0, atol=1e-5)
    # [s, b, h, d]: two sequences of 16 as a batch
    qb, kb, vb = (x[:32].reshape(2, 16, *x.shape[1:]).transpose(0, 1) for x in (q, k, v))
    unpacked = attention(qb, kb, vb, None)
    expected = _reference(q[:32], k[:32], v[:32], (16, 16)).reshape(2, 16, -1).transpose(0, 1)
    torch.testing.assert_close(unpacked, expected, rtol=0, atol=1e-5)


def _cp_rank_forward_backward(rank, world):
    import torch.distributed as dist

    q, k, v, grad_out = _inputs()
    index = _zigzag_index(SEQ_LENS, world, rank)
    local = [x[index].clone().requires_grad_(True) for x in (q, k, v)]
    attention = _attention(cp=world, group=dist.group.WORLD)
    out = attention(*local, None, packed_seq_params=_packed_params(SEQ_LENS))
    out.backward(grad_out[index])
    return index, out.detach(), [x.grad for x in local]


@pytest.mark.timeout(120)
def test_cp4_forward_and_backward_match_single_process():
    results = run_ranks(_cp_rank_forward_backward, 4, timeout_s=110)
    q, k, v, grad_out = (x.clone() for x in _inputs())
    for x in (q, k, v):
        x.requires_grad_(True)
    reference = _reference(q, k, v, SEQ_LENS)
    reference.backward(grad_out)
    out = torch.zeros_like(reference)
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for index, local_out, local_grads in results:
        out[index] = local_out
        for full, part in zip(grads, local_grads):
            full[index] = part
    torch.testing.assert_close(out, reference.detach(), rtol=0, atol=1e-5)
    for got, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, x.grad, rtol=0, atol=1e-5)
