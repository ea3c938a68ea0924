"""The project's chunk_bwd_dqkwg (slime/models/gated_delta_bwd.py) against autograd, in fla's tensor layout.

A per-chunk forward written here from the module's equations, with the WY terms (w, u), the chunk-local gate
sums and the initial states as leaves, reproduces the project's chunked rule (gated_delta_rule.py) exactly; its
states entering each chunk are fla's h, the gradients of the states leaving each chunk fla's dh, the gradient of
the corrected values fla's dv. The module must return autograd's dq, dk, dw and dG of that graph, and, added to
the WY representation's share and turned into the gate's gradient as fla does, the project's rule's gradients.
Packed sequences (partial chunks, a sequence shorter than a chunk), batches without cu_seqlens, grouped value
heads and the V-first state layout; fp64 on CPU.
"""
from __future__ import annotations

import math

import pytest
import torch

from slime.models import gated_delta_bwd as bwd
from slime.models import gated_delta_rule as gdr

TOL = 1e-10
LN2 = math.log(2.0)


def _inputs(lengths, heads, value_heads, dim_k, dim_v, batch=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = gdr.l2norm(rand(batch, total, heads, dim_k))
    k = gdr.l2norm(rand(batch, total, heads, dim_k))
    v = rand(batch, total, value_heads, dim_v)
    g = -torch.rand(batch, total, value_heads, generator=gen, dtype=torch.float64) * 0.7
    beta = torch.rand(batch, total, value_heads, generator=gen, dtype=torch.float64).sigmoid()
    state = rand(batch * len(lengths), value_heads, dim_k, dim_v)
    return q, k, v, g, beta, state


def _segments(lengths, batch, seq_len):
    """(sequence, first token, token count) of every sequence of the flattened [B*T] stream."""
    if batch > 1:
        return [(b, b * seq_len, seq_len) for b in range(batch)]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return list(zip(range(len(lengths)), starts, lengths))


def _wy_terms(k, v, gsum, beta):
    """One chunk's u and w (k [C, K] repeated to a value head, v [C, V], gate sums [C], beta [C])."""
    decay = torch.exp(gsum[:, None] - gsum[None, :]).tril(-1)
    system = torch.eye(len(gsum), dtype=k.dtype) + beta[:, None] * (k @ k.T) * decay
    inverse = torch.linalg.inv(system)
    return inverse @ (beta[:, None] * v), inverse @ (beta[:, None] * torch.exp(gsum)[:, None] * k)


class ChunkGraph:
    """The chunked forward from leaves (q, k, w, u, G, S0), recording fla's h, v_new, and (after backward) dh, dv."""

    def __init__(self, q, k, v, g, beta, state, lengths, chunk, scale):
        self.batch, self.seq_len, self.heads, _ = q.shape
        self.value_heads = v.shape[2]
        self.group = self.value_heads // self.heads
        self.chunk, self.scale = chunk, scale
        self.segments = _segments(lengths, self.batch, self.seq_len)
        flat = lambda x: x.reshape(self.batch * self.seq_len, *x.shape[2:])  # noqa: E731
        self.v, self.beta = flat(v), flat(beta)
        self.q, self.k = flat(q).detach().requires_grad_(), flat(k).detach().requires_grad_()
        self.raw_k = flat(k)  # the WY terms' k (differentiated separately in the chain test)
        gsum = torch.zeros_like(flat(g))
        for _, start, count in self.segments:  # the gate summed within each chunk (fla's chunk-local cumsum)
            for first in range(start, start + count, chunk):
                end = min(first + chunk, start + count)
                gsum[first:end] = flat(g)[first:end].cumsum(0)
        self.gsum = gsum.requires_grad_()
        self.state0 = state.detach().clone().requires_grad_()

    def wy(self, k, v, gsum, beta):
        """u and w of every token ([B*T, HV, V], [B*T, HV, K]) from differentiable inputs."""
        us, ws = torch.zeros_like(v), torch.zeros(*v.shape[:2], k.shape[-1], dtype=k.dtype)
        us, ws = list(us.unbind(1)), list(ws.unbind(1))
        for head in range(self.value_heads):
            pieces_u, pieces_w = [], []
            for _, start, count in self.segments:
                for first in range(start, start + count, self.chunk):
                    end = min(first + self.chunk, start + count)
                    u, w = _wy_terms(k[first:end, head // self.group], v[first:end, head], gsum[first:end, head],
                                     beta[first:end, head])
                    pieces_u.append((first, end, u))
                    pieces_w.append((first, end, w))
            us[head] = torch.cat([u for *_, u in sorted(pieces_u, key=lambda p: p[0])])
            ws[head] = torch.cat([w for *_, w in sorted(pieces_w, key=lambda p: p[0])])
        return torch.stack(us, 1), torch.stack(ws, 1)

    def run(self, u, w):
        """Outputs [B*T, HV, V] and final states; records h (detached), and v_new / leaving states for their grads."""
        self.h, self.v_new, self.leaving = [], [], []
        outputs, finals = [None] * (self.batch * self.seq_len), []
        for seq, start, count in self.segments:
            state = self.state0[seq]
            for first in range(start, start + count, self.chunk):
                end = min(first + self.chunk, start + count)
                self.h.append(state.detach())
                gsum = self.gsum[first:end].T                                        # [HV, c]
                q = self.q[first:end].repeat_interleave(self.group, 1).transpose(0, 1)  # [HV, c, K]
                k = self.k[first:end].repeat_interleave(self.group, 1).transpose(0, 1)
                v_new = u[first:end].transpose(0, 1) - w[first:end].transpose(0, 1) @ state  # [HV, c, V]
                v_new.retain_grad()
                self.v_new.append((first, end, v_new))
                decay = torch.exp(gsum[:, :, None] - gsum[:, None, :]).tril()
                out = self.scale * (torch.exp(gsum)[..., None] * q @ state + (q @ k.transpose(1, 2)) * decay @ v_new)
                for i, t in enumerate(range(first, end)):
                    outputs[t] = out[:, i]
                to_end = torch.exp(gsum[:, -1:] - gsum)[..., None]
                state = torch.exp(gsum[:, -1])[:, None, None] * state + (to_end * k).transpose(1, 2) @ v_new
                state.retain_grad()
                self.leaving.append(state)
            finals.append(state)
        return torch.stack(outputs), torch.stack(finals)

    def fla_layout(self, state_v_first):
        """fla's (v_new, h, dh, dv, g in log2 units, chunk_indices, cu_seqlens) after a backward."""
        tokens = self.batch * self.seq_len
        v_new = torch.zeros(tokens, self.value_heads, self.v.shape[-1], dtype=self.v.dtype)
        dv = torch.zeros_like(v_new)
        for first, end, x in self.v_new:
            v_new[first:end] = x.detach().transpose(0, 1)
            dv[first:end] = x.grad.transpose(0, 1)
        h, dh = torch.stack(self.h), torch.stack([s.grad for s in self.leaving])
        if state_v_first:
            h, dh = h.transpose(-1, -2), dh.transpose(-1, -2)
        shaped = lambda x: x.reshape(self.batch, self.seq_len, *x.shape[1:])  # noqa: E731
        pairs = [(seq, i) for seq, _, count in self.segments for i in range(-(-count // self.chunk))]
        g2 = self.gsum.detach() / LN2
        return dict(v=shaped(v_new), dv=shaped(dv), g=shaped(g2),
                    h=h.reshape(self.batch, -1, *h.shape[1:]), dh=dh.reshape(self.batch, -1, *dh.shape[1:]),
                    chunk_indices=torch.tensor(pairs) if self.batch == 1 else None)


CASES = [  # (lengths, batch, heads, value heads, dk, dv, chunk, state_v_first, cu_seqlens)
    pytest.param([37, 5, 64, 22], 1, 2, 4, 8, 6, 16, False, True, id="packed-grouped"),
    pytest.param([32, 16], 1, 1, 3, 8, 4, 16, True, True, id="packed-aligned-vfirst"),
    pytest.param([21], 2, 2, 2, 4, 8, 8, False, False, id="batch-partial-chunks"),
    pytest.param([24], 2, 1, 2, 4, 4, 8, True, False, id="batch-aligned"),
]


def _setup(lengths, batch, heads, value_heads, dim_k, dim_v, chunk, seed=0):
    q, k, v, g, beta, state = _inputs(lengths, heads, value_heads, dim_k, dim_v, batch, seed)
    scale = 0.37
    graph = ChunkGraph(q, k, v, g, beta, state, lengths, chunk, scale)
    u, w = graph.wy(graph.raw_k, graph.v, graph.gsum.detach(), graph.beta)
    u, w = u.detach().requires_grad_(), w.detach().requires_grad_()
    out, final = graph.run(u, w)
    gen = torch.Generator().manual_seed(seed + 1)
    d_out = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    d_final = torch.randn(final.shape, generator=gen, dtype=final.dtype)
    return (q, k, v, g, beta, state, scale), graph, (u, w), (out, final), (d_out, d_final)


@pytest.mark.parametrize("lengths,batch,heads,value_heads,dim_k,dim_v,chunk,v_first,packed", CASES)
def test_dqkwg_equals_autograd_of_the_chunked_graph(lengths, batch, heads, value_heads, dim_k, dim_v, chunk,
                                                     v_first, packed):
    raw, graph, (u, w), (out, final), (d_out, d_final) = _setup(lengths, batch, heads, value_heads, dim_k, dim_v,
                                                                chunk)
    q, k, v, g, beta, state, scale = raw
    # the graph is the project's chunked rule
    repeat = lambda x: x.repeat_interleave(value_heads // heads, 2)  # noqa: E731
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if packed else None
    want_out, want_final = gdr.chunk_gated_delta_rule(repeat(q), repeat(k), v, g, beta, scale=scale,
                                                      initial_state=state, output_final_state=True, cu_seqlens=cu,
                                                      chunk_size=chunk)
    assert (out.reshape(want_out.shape) - want_out).abs().max() <= TOL
    assert (final - want_final).abs().max() <= TOL

    ((out * d_out).sum() + (final * d_final).sum()).backward()  # one backward: retained grads count once
    dq, dk, dw, d_gsum = graph.q.grad, graph.k.grad, w.grad, graph.gsum.grad
    fla = graph.fla_layout(v_first)
    shaped = lambda x: x.reshape(batch, -1, *x.shape[1:])  # noqa: E731
    got = bwd.chunk_bwd_dqkwg(q=q, k=k, v=fla["v"], do=shaped(d_out), h=fla["h"], dh=fla["dh"], w=shaped(w),
                              g=fla["g"], dv=fla["dv"], scale=scale, state_v_first=v_first, cu_seqlens=cu,
                              chunk_size=chunk, chunk_indices=fla["chunk_indices"])
    for name, mine, ref in zip(("dq", "dk", "dw", "dg"), got, (dq, dk, dw, d_gsum)):
        assert mine.shape == shaped(ref).shape, name
        assert (mine - shaped(ref)).abs().max() <= TOL * max(1.0, ref.abs().max().item()), name


@pytest.mark.parametrize("lengths,batch,heads,value_heads,dim_k,dim_v,chunk,v_first,packed", CASES[:1] + CASES[2:3])
def test_dqkwg_plus_the_wy_share_gives_the_rules_gradients(lengths, batch, heads, value_heads, dim_k, dim_v, chunk,
                                                           v_first, packed):
    """fla's composition: dq from dqkwg; dk, dG plus the WY terms' share; dg = reversed cumsum of dG per chunk."""
    raw, graph, (u, w), (out, final), (d_out, d_final) = _setup(lengths, batch, heads, value_heads, dim_k, dim_v,
                                                                chunk, seed=3)
    q, k, v, g, beta, state, scale = raw
    (out * d_out).sum().add((final * d_final).sum()).backward()
    fla = graph.fla_layout(v_first)
    shaped = lambda x: x.reshape(batch, -1, *x.shape[1:])  # noqa: E731
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if packed else None
    dq, dk, dw, d_gsum = bwd.chunk_bwd_dqkwg(q=q, k=k, v=fla["v"], do=shaped(d_out), h=fla["h"], dh=fla["dh"],
                                             w=shaped(w), g=fla["g"], dv=fla["dv"], scale=scale,
                                             state_v_first=v_first, cu_seqlens=cu, chunk_size=chunk)
    # the WY share: u, w as functions of k, v, beta and the gate sums, pulled back with du = dv, dw
    leaves = [x.detach().requires_grad_() for x in (graph.raw_k, graph.v, graph.beta, graph.gsum)]
    wy_u, wy_w = graph.wy(*leaves[:2], leaves[3], leaves[2])
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    dk_wy, dv_wy, dbeta, dgsum_wy = torch.autograd.grad([wy_u, wy_w], leaves,
                                                         [flat(fla["dv"]), flat(dw)])
    total_gsum = flat(d_gsum) + dgsum_wy
    dg = torch.zeros_like(total_gsum)
    for _, start, count in graph.segments:  # reversed cumulative sum within each chunk
        for first in range(start, start + count, chunk):
            end = min(first + chunk, start + count)
            dg[first:end] = total_gsum[first:end].flip(0).cumsum(0).flip(0)

    leaves_rule = [x.detach().requires_grad_() for x in (q, k, v, g, beta, state)]
    repeat = lambda x: x.repeat_interleave(value_heads // heads, 2)  # noqa: E731
    ro, rf = gdr.chunk_gated_delta_rule(repeat(leaves_rule[0]), repeat(leaves_rule[1]), *leaves_rule[2:5],
                                        scale=scale, initial_state=leaves_rule[5], output_final_state=True,
                                        cu_seqlens=cu, chunk_size=chunk)
    want = torch.autograd.grad((ro * d_out.reshape(ro.shape)).sum() + (rf * d_final).sum(), leaves_rule)
    got = {"q": dq, "k": dk + shaped(dk_wy), "v": shaped(dv_wy), "g": shaped(dg), "beta": shaped(dbeta)}
    for name, ref in zip(("q", "k", "v", "g", "beta"), want):
        assert (got[name] - ref).abs().max() <= TOL * max(1.0, ref.abs().max().item()), name


def test_refuses_what_it_does_not_cover():
    q = torch.zeros(1, 4, 2, 4)
    v = torch.zeros(1, 4, 3, 4)
    h = torch.zeros(1, 1, 3, 4, 4)
    with pytest.raises(ValueError, match="per-token gate"):
        bwd.chunk_bwd_dqkwg(q, q, v, v, h, h)
    with pytest.raises(ValueError, match="not a multiple"):
        bwd.chunk_bwd_dqkwg(q, q, v, v, h, h, g=torch.zeros(1, 4, 3))
