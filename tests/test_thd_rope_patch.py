"""slime.patches.megatron_core.apply_thd_rope: megatron's unfused THD RoPE without a host read of
cu_seqlens, bit-identical to megatron's own (forward and gradient, CP zig-zag, both frequency
table layouts)."""

from __future__ import annotations

import types

import pytest
import torch

from host_reads import HostReadForbidden


@pytest.fixture(scope="module")
def rope():
    """(megatron's own THD RoPE, the installed one)."""
    from slime import patches
    from slime.patches import megatron_core

    patches.apply_all()
    from megatron.core.models.common.embeddings import rope_utils

    megatron_core.apply_thd_rope(enabled=False)
    upstream = rope_utils._apply_rotary_pos_emb_thd
    megatron_core.apply_thd_rope()
    return upstream, rope_utils._apply_rotary_pos_emb_thd


def _cp_group(size: int, rank: int):
    return types.SimpleNamespace(size=lambda: size, rank=lambda: rank)


CASES = [(1, (5, 16, 7)), (2, (16, 8, 40)), (4, (16, 32, 8))]


@pytest.mark.parametrize("cp,lens", CASES)
@pytest.mark.parametrize("table", ["longest", "whole_batch"])
def test_patched_thd_rope_is_bit_identical_to_megatron(rope, cp, lens, table):
    upstream, patched = rope
    assert patched is not upstream
    cu = torch.tensor((0,) + lens).cumsum(0).to(torch.int32)
    gen = torch.Generator().manual_seed(cp)
    freqs = torch.randn(max(lens) if table == "longest" else sum(lens), 1, 1, 8, generator=gen)
    for rank in range(cp):
        t = torch.randn(sum(lens) // cp, 3, 8, generator=gen)
        grad = torch.randn_like(t)
        outs, grads = [], []
        for fn in (upstream, patched):
            leaf = t.clone().requires_grad_(True)
            out = fn(leaf, cu, freqs, cp_group=_cp_group(cp, rank))
            out.backward(grad)
            outs.append(out.detach())
            grads.append(leaf.grad)
        assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1]), (cp, rank, table)


def test_patched_thd_rope_never_reads_cu_seqlens_on_the_host(rope):
    upstream, patched = rope
    lens = (16, 8, 40)
    cu = torch.tensor((0,) + lens).cumsum(0).to(torch.int32).as_subclass(HostReadForbidden)
    t, freqs = torch.randn(32, 2, 8), torch.randn(40, 1, 1, 8)
    patched(t, cu, freqs, cp_group=_cp_group(2, 1))
    with pytest.raises(AssertionError, match="host read"):  # what the patch removes: .tolist() per call
        upstream(t, cu, freqs, cp_group=_cp_group(2, 1))


def test_thd_rope_positions_follow_the_zigzag_layout():
    from slime.patches.megatron_core import thd_rope_positions
    from slime_plugins.models.cp_attention import zigzag_positions

    lens = (8, 16)
    cu = torch.tensor((0,) + lens).cumsum(0)
    for rank in range(2):
        want = torch.cat([zigzag_positions(n, 2, rank) for n in lens])
        assert torch.equal(thd_rope_positions(cu, 12, 2, rank, batch_offsets=False), want)
        offsets = torch.cat([torch.full((n // 2,), start) for start, n in zip((0, 8), lens)])
        assert torch.equal(thd_rope_positions(cu, 12, 2, rank, batch_offsets=True), want + offsets)


def test_apply_thd_rope_can_restore_megatron_and_back(rope):
    upstream, patched = rope
    from megatron.core.models.common.embeddings import rope_utils

    from slime.patches import megatron_core

    megatron_core.apply_thd_rope(enabled=False)
    try:
        assert rope_utils._apply_rotary_pos_emb_thd is upstream and megatron_core.thd_rope_in_use() == "megatron"
    finally:
        megatron_core.apply_thd_rope()
    assert rope_utils._apply_rotary_pos_emb_thd is patched and megatron_core.thd_rope_in_use() == "patched"
