"""The gated delta rule's chunk-local gradients in q, k, w and the gate, in flash-linear-attention's tensor layout.

flash-linear-attention (fla) 0.6 computes the gated delta rule's backward in several kernels; one of them,
`chunk_bwd_dqkwg` (fla/ops/common/chunk_o.py), is refused on Hopper with Triton >= 3.4 and < 3.7.1 (that Triton
miscompiles it). This module is the project's own maths for that one step, batched torch over all chunks, so the
rest of fla's forward and backward still runs as Triton kernels (fla_backend.py plugs it into fla's registry).

Per chunk of C tokens (fla's names: h the state entering the chunk [K, V], v the chunk's corrected values
v_new = u - w h, G_t the gate summed over the chunk up to t), the forward is

    o_t    = scale (e^{G_t} q_t h + sum_{s <= t} e^{G_t - G_s} (q_t . k_s) v_s)
    h_next = e^{G_C} h + sum_s e^{G_C - G_s} k_s v_s^T

and, given do (the outputs' gradient), dv (the total gradient of v_new) and dh (the gradient of h_next), this
module returns what those two lines and v_new = u - w h contribute:

    dq_t = scale e^{G_t} do_t h^T + sum_{s <= t} ds_ts k_s,       ds_ts = scale e^{G_t - G_s} (do_t . v_s)
    dk_s = e^{G_C - G_s} v_s dh^T + sum_{t >= s} ds_ts q_t
    dw_t = -dv_t h^T
    dG_t = q_t . dq_t - k_t . dk_t  (+ e^{G_C} <h, dh> + sum_s k_s . (e^{G_C - G_s} v_s dh^T) at t = C)

fla then adds the WY representation's share of dk and dG and turns dG into the gradient of g by a reversed
cumulative sum within each chunk. Layouts (fla's): q, k [B, T, H, K]; v, do, dv [B, T, HV, V]; w [B, T, HV, K];
g [B, T, HV] fp32, the chunk-local cumulative sum of the log decay in log2 units (e^{G_t} = 2^{g_t}); h, dh
[B, NT, HV, K, V] ([.., V, K] with `state_v_first`), chunks of each sequence in order, sequence after sequence.
Value head j reads key head j // (HV / H); dq and dk are summed over the value heads of a key head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ChunkGrid:
    """fla's chunks of a [B, T] token grid: chunk c holds slots c*C .. c*C + C - 1 (flattened tokens b*T + t)."""

    num_chunks: int
    chunk_size: int
    aligned: bool             # every chunk full: the chunked tensors are views of the token tensors
    source: Tensor | None     # [num_chunks * C] long: the token each slot reads (padding: its chunk's last token)
    real: Tensor | None       # [num_chunks * C] bool: slots that hold a token
    last: Tensor | None       # [num_chunks] long: position (0 .. C-1) of each chunk's last token
    slot: Tensor | None       # [B * T] long: the slot of each token


def _chunk_indices_of(cu_seqlens: Tensor, chunk_size: int) -> Tensor:
    """(sequence, chunk number) of every chunk in fla's order (one host read of cu_seqlens; fla passes its own)."""
    bounds = cu_seqlens.tolist()
    pairs = [(n, i) for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) for i in range(-(-(b - a) // chunk_size))]
    return torch.tensor(pairs, dtype=torch.long, device=cu_seqlens.device).reshape(-1, 2)


def chunk_grid(batch: int, seq_len: int, chunk_size: int, cu_seqlens: Tensor | None,
               chunk_indices: Tensor | None, device: torch.device) -> ChunkGrid:
    """The chunk layout fla's kernels use, built on the device without a host sync (given chunk_indices)."""
    total = batch * seq_len
    if cu_seqlens is None:
        per_row = -(-seq_len // chunk_size)
        num_chunks = batch * per_row
        if num_chunks * chunk_size == total:
            return ChunkGrid(num_chunks, chunk_size, True, None, None, None, None)
        sequence = torch.arange(batch, device=device).repeat_interleave(per_row)
        number = torch.arange(per_row, device=device).repeat(batch)
        starts = torch.arange(batch, device=device) * seq_len
        ends = starts + seq_len
    else:
        if chunk_indices is None:
            chunk_indices = _chunk_indices_of(cu_seqlens, chunk_size)
        num_chunks = chunk_indices.shape[0]
        if num_chunks * chunk_size == total:  # a partial chunk anywhere would need one more chunk than this
            return ChunkGrid(num_chunks, chunk_size, True, None, None, None, None)
        sequence, number = chunk_indices[:, 0].long(), chunk_indices[:, 1].long()
        bounds = cu_seqlens.to(device=device, dtype=torch.long)
        starts, ends = bounds[:-1], bounds[1:]
    first = starts[sequence] + number * chunk_size
    end = torch.minimum(first + chunk_size, ends[sequence])
    tokens = first[:, None] + torch.arange(chunk_size, device=device)
    real = (tokens < end[:, None]).flatten()
    source = torch.minimum(tokens, end[:, None] - 1).flatten()
    slots = torch.arange(num_chunks * chunk_size, device=device)
    # padding slots all write to the extra entry `total`, which is dropped
    slot = torch.full((total + 1,), total, dtype=torch.long, device=device)
    slot = slot.scatter(0, torch.where(real, source, total), slots)[:total]
    return ChunkGrid(num_chunks, chunk_size, False, source, real, end - first - 1, slot)


def to_chunks(x: Tensor, grid: ChunkGrid, *, zero_padding: bool = False) -> Tensor:
    """[B, T, heads, ...] -> [num_chunks, heads, C, ...] (contiguous). Padding slots repeat their chunk's last token,
    or hold zeros with `zero_padding`."""
    flat = x.reshape(-1, *x.shape[2:])
    if grid.aligned:
        chunks = flat.view(grid.num_chunks, grid.chunk_size, *x.shape[2:])
    else:
        chunks = flat.index_select(0, grid.source)
        if zero_padding:
            chunks = chunks * grid.real.view(-1, *([1] * (chunks.dim() - 1))).to(chunks.dtype)
        chunks = chunks.view(grid.num_chunks, grid.chunk_size, *x.shape[2:])
    return chunks.transpose(1, 2).contiguous()


def from_chunks(chunks: Tensor, grid: ChunkGrid, like: Tensor, dtype: torch.dtype) -> Tensor:
    """[num_chunks, heads, C, ...] -> [B, T, heads, ...] shaped like `like`'s first two dimensions, in `dtype`."""
    num, heads, size, *rest = chunks.shape
    flat = torch.empty(num, size, heads, *rest, dtype=dtype, device=chunks.device)
    flat.copy_(chunks.transpose(1, 2))  # one pass: transposed and cast
    flat = flat.view(num * size, heads, *rest)
    if not grid.aligned:
        flat = flat.index_select(0, grid.slot)
    return flat.view(*like.shape[:2], heads, *rest)


def wide(x: Tensor) -> Tensor:
    """x in fp32 at least (fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


_half_into_fp32 = [True]  # cleared if this torch's CUDA bmm refuses out_dtype (then operands are widened)


def matmul_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b (batched alike) in fp32 at least: 16-bit CUDA operands straight into an fp32 result (no upcast
    copies), anything else widened first."""
    if a.dtype in _HALF and a.dtype == b.dtype and a.is_cuda and _half_into_fp32[0]:
        batch = a.shape[:-2]
        try:
            product = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=torch.float32)
            return product.view(*batch, *product.shape[-2:])
        except (RuntimeError, TypeError, NotImplementedError):
            _half_into_fp32[0] = False
    return torch.matmul(wide(a), wide(b))


def chunk_bwd_dqkwg(q: Tensor, k: Tensor, v: Tensor, do: Tensor, h: Tensor, dh: Tensor, w: Tensor | None = None,
                    g: Tensor | None = None, g_gamma: Tensor | None = None, dv: Tensor | None = None,
                    scale: float | None = None, state_v_first: bool = False, cu_seqlens: Tensor | None = None,
                    chunk_size: int = 64, chunk_indices: Tensor | None = None
                    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """(dq [B, T, H, K] in q's dtype, dk in k's, dw like w or None, dG [B, T, HV] fp32): fla's `chunk_bwd_dqkwg`
    for a per-token gate g (the module docstring has the maths and layouts). `v` is fla's v_new."""
    if g is None or g_gamma is not None:
        raise ValueError("chunk_bwd_dqkwg: the project's maths covers the per-token gate g alone (no g_gamma)")
    if (w is None) != (dv is None):
        raise ValueError("chunk_bwd_dqkwg: w and dv come together (the delta rule's correction) or not at all")
    batch, seq_len, heads, dim_k = k.shape
    value_heads = v.shape[2]
    if value_heads % heads:
        raise ValueError(f"chunk_bwd_dqkwg: {value_heads} value heads are not a multiple of {heads} key heads")
    group = value_heads // heads
    scale = dim_k ** -0.5 if scale is None else scale
    grid = chunk_grid(batch, seq_len, chunk_size, cu_seqlens, chunk_indices, k.device)
    n, size = grid.num_chunks, chunk_size

    q_c, k_c = to_chunks(q, grid), to_chunks(k, grid)                                   # [n, H, C, K]
    v_c, do_c = to_chunks(v, grid, zero_padding=True), to_chunks(do, grid, zero_padding=True)  # [n, HV, C, V]
    gate = to_chunks(wide(g).unsqueeze(-1), grid).squeeze(-1)                          # [n, HV, C]
    flat_state, flat_state_grad = (x.reshape(n, value_heads, *x.shape[-2:]) for x in (h, dh))
    state, state_grad = flat_state, flat_state_grad
    if not state_v_first:  # [K, V] -> the [V, K] the products below take
        state, state_grad = state.transpose(-1, -2), state_grad.transpose(-1, -2)

    to_end = torch.exp2(gate[..., -1:] - gate)  # e^{G_C - G_t}; padding slots repeat the last token's gate
    causal = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
    # scale e^{G_t - G_s} for s <= t (the scale folded into the exponent)
    decay = torch.exp2((gate[..., :, None] - gate[..., None, :] + math.log2(scale)).masked_fill(~causal, -math.inf))

    dq_heads = matmul_fp32(do_c, state).mul_((torch.exp2(gate) * scale)[..., None])   # [n, HV, C, K]
    dk_heads = matmul_fp32(v_c, state_grad).mul_(to_end[..., None])
    ds = matmul_fp32(do_c, v_c.transpose(-1, -2)).mul_(decay)                           # [n, HV, C, C]
    scores = matmul_fp32(q_c, k_c.transpose(-1, -2))                                    # [n, H, C, C]

    def grouped(x: Tensor) -> Tensor:  # [n, HV, ...] -> [n, H, HV / H, ...]
        return x.view(n, heads, group, *x.shape[2:])

    def per_key_head(x: Tensor) -> Tensor:  # summed over the value heads of each key head
        return x if group == 1 else grouped(x).sum(2)

    q_dot = (grouped(dq_heads) * q_c.unsqueeze(2)).sum(-1)                              # [n, H, r, C]
    k_dot = (grouped(dk_heads) * k_c.unsqueeze(2)).sum(-1)
    weighted = grouped(ds) * scores.unsqueeze(2)                                        # [n, H, r, C, C]
    d_gate = (q_dot - k_dot + weighted.sum(-1) - weighted.sum(-2)).reshape(n, value_heads, size)
    state_dot = matmul_fp32(flat_state.reshape(n * value_heads, 1, -1),  # <h, dh>: any layout, no copies
                            flat_state_grad.reshape(n * value_heads, -1, 1)).view(n, value_heads)
    last = torch.exp2(gate[..., -1]) * state_dot + k_dot.sum(-1).reshape(n, value_heads)
    last_position = (torch.full((n,), size - 1, device=k.device) if grid.aligned else grid.last)
    d_gate = d_gate.scatter_add(2, last_position.view(n, 1, 1).expand(n, value_heads, 1), last[..., None])

    ds_keys = per_key_head(ds).to(k_c.dtype)  # [n, H, C, C], in the inputs' precision as fla's kernel has it
    dq = per_key_head(dq_heads).add_(matmul_fp32(ds_keys, k_c))
    dk = per_key_head(dk_heads).add_(matmul_fp32(ds_keys.transpose(-1, -2), q_c))
    dw = None
    if w is not None:
        dw = from_chunks(matmul_fp32(to_chunks(dv, grid), state), grid, w, w.dtype).neg_()
    d_gate = from_chunks(d_gate.unsqueeze(-1), grid, g, wide(g).dtype).squeeze(-1)
    return from_chunks(dq, grid, q, q.dtype), from_chunks(dk, grid, k, k.dtype), dw, d_gate
