"""The chunked Kimi delta rule (KDA, Kimi-Linear's linear attention): the gated delta rule with one decay per key
channel instead of one per head (gated_delta_rule.py is the per-head rule; this is its sibling on the same
chunk layout, recurrence scan and packing).

Per head, a state S (Dk x Dv) is updated per token with a_t = exp(g_t) in R^Dk (g_t <= 0, one per key channel):

    S_t = diag(a_t) S_{t-1} + beta_t k_t (v_t - (diag(a_t) S_{t-1})^T k_t)^T,        o_t = S_t^T (scale q_t)

(transformers' `recurrent_kimi_delta_attention`). Per chunk of C tokens with G_t = sum of g over the chunk up to t
(a vector) and the state S entering the chunk, the per-head rule's algebra holds with every decay per channel:

    A_ts = beta_t sum_c k_t[c] k_s[c] e^(G_t[c] - G_s[c])  (s < t),   T = (I + A)^-1
    Wv = T beta V,  Wk = T beta (e^G * K),  U = Wv - Wk S               (the chunk's deltas)
    O  = P Wv + (e^G * Q - P Wk) S,        P_ts = sum_c q_t[c] k_s[c] e^(G_t[c] - G_s[c])  (s <= t)
    S_next = diag(e^(G_C)) S + Kd^T U,     Kd_t = e^(G_C - G_t) * k_t

The pairwise decays e^(G_t - G_s) (s <= t: exponents <= 0, never overflowing) are formed explicitly, [C, C, Dk] per
chunk and head: the memory of a chunk grows as C^2 Dk, so the default chunk is 16 tokens (the per-head rule's 64
would need 16x more). The state recurrence across chunks is gated_delta_rule's scan (its decay broadcasts per
channel). On CUDA the chunk terms and outputs are torch.compile'd, as the per-head rule's are; flash-linear-attention's
KDA kernels are not used here.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from slime.models.gated_delta_rule import _torch_rule, chunk_outputs, compile_chunk_functions, unit_lower_inverse

KDA_CHUNK_SIZE = 16


def kda_chunk_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per chunk, all at once: (O_intra, Qeff, Wv, Wk, Kd^T, e^{G_C} per channel [.., Dk, 1]); q, k [.., C, Dk] (q
    already scaled), v [.., C, Dv], g [.., C, Dk], beta [.., C]. gated_delta_rule._scan_states and chunk_outputs take
    them as they take the per-head rule's."""
    size = g.shape[-2]
    cum = g.cumsum(-2)
    lower = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()
    pair = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(~lower[:, :, None], float("-inf")).exp()
    keyed = pair * k.unsqueeze(-3)  # [.., t, s, c]: k_s[c] e^(G_t[c] - G_s[c])
    strict = beta[..., :, None] * (keyed @ k.unsqueeze(-1)).squeeze(-1)
    system = strict.tril(-1) + torch.eye(size, dtype=g.dtype, device=g.device)
    gate = cum.exp()
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * gate * k], dim=-1)
    solved = unit_lower_inverse(system) @ rhs
    w_v, w_k = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    attend = (keyed @ q.unsqueeze(-1)).squeeze(-1)
    o_intra = attend @ w_v
    q_eff = q * gate - attend @ w_k
    k_decayed_t = (k * (cum[..., -1:, :] - cum).exp()).transpose(-1, -2)
    return o_intra, q_eff, w_v, w_k, k_decayed_t, cum[..., -1, :].exp().unsqueeze(-1)


@functools.lru_cache(maxsize=None)
def _compiled() -> tuple:
    """kda_chunk_terms and chunk_outputs compiled for CUDA (built on first use; never on CPU)."""
    return compile_chunk_functions(kda_chunk_terms, chunk_outputs)


def chunk_kda_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                   initial_state: Tensor | None = None, output_final_state: bool = False,
                   cu_seqlens: Tensor | None = None, chunk_size: int = KDA_CHUNK_SIZE) -> tuple[Tensor, Tensor | None]:
    """The Kimi delta rule over q, k [B, T, H, Dk] (l2-normalised), v [B, T, H, Dv], g [B, T, H, Dk] (log decay per
    key channel, <= 0) and beta [B, T, H]; returns (o [B, T, H, Dv] in v's dtype, the final states [N, H, Dk, Dv] in
    fp32 or None). With `cu_seqlens` (B = 1) the state restarts at every sequence start, from zero or
    `initial_state[i]`. Differentiable in every input. Compiled on CUDA, eager elsewhere."""
    if g.shape != (*q.shape[:3], q.shape[3]) or v.shape[2] != q.shape[2]:
        raise ValueError(f"KDA: g must be [B, T, H, Dk] = {tuple(q.shape)} and v have q's heads; got g "
                         f"{tuple(g.shape)}, v {tuple(v.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    terms, outputs = _compiled() if q.is_cuda else (kda_chunk_terms, chunk_outputs)
    return _torch_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                       terms=terms, outputs=outputs)


def recurrent_kda_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                       initial_state: Tensor | None = None, output_final_state: bool = False,
                       cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The token-by-token recurrence (same API): the reference the chunked rule is tested against. Slow."""
    acc = torch.promote_types(v.dtype, torch.float32)
    batch, total, heads, dim_k = q.shape
    scale = dim_k ** -0.5 if scale is None else scale
    bounds = [0, total] if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    rows = [(b, bounds[i], bounds[i + 1]) for b in range(batch) for i in range(len(bounds) - 1)]
    out = torch.zeros(batch, total, heads, v.shape[-1], dtype=acc, device=v.device)
    finals = []
    for n, (b, start, end) in enumerate(rows):
        state = (torch.zeros(heads, dim_k, v.shape[-1], dtype=acc, device=v.device) if initial_state is None
                 else initial_state[n].to(acc))
        for t in range(start, end):
            q_t, k_t, v_t, g_t, b_t = (x[b, t].to(acc) for x in (q, k, v, g, beta))
            state = state * g_t.exp()[:, :, None]
            delta = b_t[:, None] * (v_t - torch.einsum("hkv,hk->hv", state, k_t))
            state = state + k_t[:, :, None] * delta[:, None, :]
            out[b, t] = torch.einsum("hkv,hk->hv", state, q_t * scale)
        finals.append(state)
    return out.to(v.dtype), (torch.stack(finals) if output_final_state else None)
