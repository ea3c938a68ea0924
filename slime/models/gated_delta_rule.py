"""Gated DeltaNet kernels: the chunked gated delta rule, the depthwise causal convolution, l2norm.

The linear-attention layers of Qwen3-Next / Qwen3.5 keep, per value head, a state S (Dk x Dv) updated per token:

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,   a_t = exp(g_t),   o_t = S_t^T (scale q_t)

(transformers' `torch_recurrent_gated_delta_rule` semantics). The chunked form used here, per chunk of C tokens
with G_t = sum of g over the chunk up to t, D_ts = exp(G_t - G_s) for s <= t and state S entering the chunk:

    the deltas u_t = beta_t (v_t - a_t S_{t-1}^T k_t) solve (I + A) U = beta V - beta e^G K S,
        A_ts = beta_t D_ts k_t.k_s (s < t): with T = (I + A)^-1, U = Wv - Wk S, Wv = T beta V, Wk = T beta e^G K;
    O      = P Wv + (e^G Q - P Wk) S,        P_ts = D_ts q_t.k_s (s <= t)
    S_next = e^{G_C} S + Kd^T U,             Kd_t = e^{G_C - G_t} k_t

Everything but the state recurrence across chunks (two C x Dk x Dv matmuls per chunk) is computed for all
chunks at once, and the outputs from the states afterwards. Packed sequences (`cu_seqlens`) are cut into chunks
that never cross a sequence start; chunks are laid out step-major (every sequence's j-th chunk together, longest
sequences first) so that step j of the recurrence reads one contiguous slice and finished sequences drop out.

Which implementation runs is decided once per process by `choose_kernel` (see its docstring and docs/gpu.md):
flash-linear-attention's Triton kernels on CUDA where it is installed and trusted; on Hopper with a Triton whose
gated `chunk_bwd_dqkwg` fla refuses, fla's kernels with the project's maths for that one step (fla_backend.py,
checked against this file's rule on first use of each head shape); else this file's chunked rule compiled with
torch.compile on CUDA, else (CPU) the same rule eager.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from slime.models import fla_backend

logger = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "torch", "compiled", "fla", "fla-dqkwg")
KERNEL_ENV = "SLIME_GDN_KERNEL"
# Set by tests and benchmarks to force an implementation in this process (takes precedence over the env var).
KERNEL_OVERRIDE: str | None = None
FLA_CHUNK_SIZES = (16, 32, 64)
# fla-dqkwg's first-use check runs this many tokens (fla tunes its kernels on that first call; ~1 GiB transient)
CHECK_TOKENS = 2048
# fla 0.6 refuses (RuntimeError in backward) the gated chunk_bwd_dqkwg on Hopper with Triton in this range.
_BAD_TRITON_ON_HOPPER = ((3, 4, 0), (3, 7, 1))


# ----------------------------------------------------------------------------------------------- small pieces


def l2norm(x: Tensor, dim: int = -1, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) along `dim` (transformers' and fla's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _sequence_ids(cu_seqlens: Tensor, total: int) -> Tensor:
    """The index of the sequence each of `total` packed tokens belongs to."""
    positions = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                  activation: str | None = "silu", cu_seqlens: Tensor | None = None) -> Tensor:
    """Depthwise causal convolution of x [B, T, C] by weight [C, K]; output t sees inputs t-K+1..t of its sequence.

    With `cu_seqlens` (B must be 1) every sequence starts from zero padding: K-1 zero rows are inserted before
    each sequence, one convolution runs over the whole stream, and the rows of the real tokens are read back.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: activation must be None or 'silu', not {activation!r}")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"causal_conv1d: x must be [B, T, C] and weight [C, K]; got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    batch, total, channels = x.shape
    width = weight.shape[1]
    stream = x.to(weight.dtype).transpose(1, 2)  # [B, C, T]
    if cu_seqlens is None:
        out = F.conv1d(stream, weight.unsqueeze(1), bias, padding=width - 1, groups=channels)[..., :total]
    else:
        if batch != 1:
            raise ValueError(f"causal_conv1d: with cu_seqlens x must be [1, T, C] (packed), got batch {batch}")
        num_seqs = cu_seqlens.numel() - 1
        # Token t of sequence s moves to t + (s + 1)(K - 1): K - 1 zero columns precede every sequence.
        dest = torch.arange(total, device=x.device) + (_sequence_ids(cu_seqlens, total) + 1) * (width - 1)
        padded = stream.new_zeros(1, channels, total + num_seqs * (width - 1))
        padded = padded.index_copy(2, dest, stream)
        full = F.conv1d(padded, weight.unsqueeze(1), bias, groups=channels)  # output p ends at input p + K - 1
        out = full.index_select(2, dest - (width - 1))
    if activation is not None:
        out = F.silu(out)
    return out.transpose(1, 2).to(x.dtype)


# ------------------------------------------------------------------------------------------------ chunk layout


@dataclass(frozen=True)
class ChunkLayout:
    """Where each token of a packed stream sits in the step-major chunk list, and the recurrence's schedule.

    Chunk list entry p covers tokens `token_index[p * C : (p + 1) * C]` (index `total` = a zero padding row).
    Step j of the recurrence updates the first `active[j]` sequences (in `order`, longest first) from the
    contiguous chunks `offsets[j] : offsets[j] + active[j]`.
    """

    chunk_size: int
    total: int
    token_index: Tensor       # [num_chunks * C] long: source token of each chunk slot, `total` for padding
    slot_of_token: Tensor     # [total] long: the chunk slot of each token
    order: Tensor             # [N] long: sequences by decreasing chunk count (ties by position)
    active: tuple[int, ...]   # per step, how many sequences still have a chunk
    offsets: tuple[int, ...]  # per step, the first chunk of that step

    @property
    def num_chunks(self) -> int:
        return self.offsets[-1] + self.active[-1] if self.active else 0


@functools.lru_cache(maxsize=16)
def plan_chunks(lengths: tuple[int, ...], chunk_size: int, device: torch.device) -> ChunkLayout:
    """The step-major chunk layout of sequences of these lengths packed back to back (cached: every layer of a
    micro-batch has the same packing)."""
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two (64 is the default), got {chunk_size}")
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    counts = [-(-n // chunk_size) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda s: (-counts[s], s))
    steps = max(counts, default=0)
    active = tuple(sum(1 for s in order if counts[s] > j) for j in range(steps))
    offsets = tuple(sum(active[:j]) for j in range(steps))
    # Chunk p's sequence and chunk number, in step-major order.
    seq_of_chunk = [order[i] for j in range(steps) for i in range(active[j])]
    step_of_chunk = [j for j in range(steps) for _ in range(active[j])]
    seq = torch.tensor(seq_of_chunk, dtype=torch.long)
    first = torch.tensor(step_of_chunk, dtype=torch.long) * chunk_size
    within = first[:, None] + torch.arange(chunk_size)[None, :]  # token number inside its sequence
    total = starts[-1]
    inside = within < torch.tensor(lengths, dtype=torch.long)[seq][:, None]
    token_index = torch.where(inside, torch.tensor(starts[:-1], dtype=torch.long)[seq][:, None] + within,
                              torch.full_like(within, total)).reshape(-1)
    slot_of_token = torch.empty(total, dtype=torch.long)
    real = token_index < total
    slot_of_token[token_index[real]] = torch.arange(token_index.numel())[real]
    return ChunkLayout(chunk_size=chunk_size, total=total, token_index=token_index.to(device),
                       slot_of_token=slot_of_token.to(device),
                       order=torch.tensor(order, dtype=torch.long, device=device), active=active, offsets=offsets)


def _to_chunks(x: Tensor, layout: ChunkLayout, dtype: torch.dtype) -> Tensor:
    """[T, H, ...] packed tokens -> [num_chunks, H, C, ...] in `dtype`, padding slots zero."""
    padded = torch.cat([x.to(dtype), x.new_zeros((1,) + x.shape[1:], dtype=dtype)])
    chunks = padded.index_select(0, layout.token_index)
    chunks = chunks.reshape(layout.num_chunks, layout.chunk_size, *x.shape[1:])
    return chunks.transpose(1, 2)


# ------------------------------------------------------------------------------------------ the chunked maths


def unit_lower_inverse(lower: Tensor) -> Tensor:
    """The inverse of unit lower-triangular matrices [..., C, C] (C a power of two), by doubling diagonal blocks:
    inv [[A, 0], [B, D]] = [[inv A, 0], [-inv D B inv A, inv D]]. Matmuls only (batched triangular solves are
    slow on CPU and GPU alike), and the same algebra as forward substitution, so no series that could cancel."""
    size, batch = lower.shape[-1], lower.shape[:-2]
    inv = torch.ones(*batch, size, 1, 1, dtype=lower.dtype, device=lower.device)  # the 1 x 1 diagonal blocks
    half = 1
    while half < size:
        pairs = size // (2 * half)
        blocks = lower.reshape(*batch, pairs, 2 * half, pairs, 2 * half).diagonal(dim1=-4, dim2=-2)
        below = blocks[..., half:, :half, :].movedim(-1, -3)  # [..., pairs, half, half]
        first, second = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        top = torch.cat([first, torch.zeros_like(first)], dim=-1)
        inv = torch.cat([top, torch.cat([-(second @ below @ first), second], dim=-1)], dim=-2)
        half *= 2
    return inv.reshape(*batch, size, size)


def chunk_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per chunk, all at once: (O_intra, Qeff, Wv, Wk, Kd^T, e^{G_C}).

    Inputs are [.., C, D] (q already scaled) and [.., C] for g and beta. With S the state entering the chunk,
    the chunk's deltas are U = Wv - Wk S, its output O_intra + Qeff S and the state leaving it
    e^{G_C} S + Kd^T U.
    """
    size = g.shape[-1]
    cum = g.cumsum(-1)
    lower = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()
    # exp(G_t - G_s) for s <= t only: the masked (upper) differences are positive and must not reach exp.
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    strict = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay
    system = strict.tril(-1) + torch.eye(size, dtype=g.dtype, device=g.device)
    gate = cum.exp()[..., None]
    rhs = torch.cat([beta[..., None] * v, (beta[..., None] * gate) * k], dim=-1)
    solved = unit_lower_inverse(system) @ rhs
    w_v, w_k = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    attend = (q @ k.transpose(-1, -2)) * decay
    o_intra = attend @ w_v
    q_eff = q * gate - attend @ w_k
    k_decayed_t = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)
    return o_intra, q_eff, w_v, w_k, k_decayed_t, cum[..., -1, None, None].exp()


def chunk_outputs(o_intra: Tensor, q_eff: Tensor, states: Tensor) -> Tensor:
    """Each chunk's output from the state entering it."""
    return o_intra + q_eff @ states


def _scan_states(w_v: Tensor, w_k: Tensor, k_decayed_t: Tensor, chunk_decay: Tensor, state: Tensor,
                 layout: ChunkLayout) -> tuple[Tensor, Tensor]:
    """(the state entering every chunk [num_chunks, H, Dk, Dv], the final states in `layout.order`).

    Two small matmuls per step (C x Dk x Dv each), the only sequential part of the rule.
    """
    entering, finished = [], []
    for start, count in zip(layout.offsets, layout.active):
        if count < state.shape[0]:  # the shortest sequences are done: keep their final state, drop them
            finished.append(state[count:])
            state = state[:count]
        entering.append(state)
        step = slice(start, start + count)
        flat_state = state.flatten(0, 1)
        deltas = torch.baddbmm(w_v[step].flatten(0, 1), w_k[step].flatten(0, 1), flat_state, alpha=-1)
        decayed = (state * chunk_decay[step]).flatten(0, 1)
        state = torch.baddbmm(decayed, k_decayed_t[step].flatten(0, 1), deltas).view_as(state)
    finished.append(state)
    return torch.cat(entering), torch.cat(finished[::-1])


# ----------------------------------------------------------------------------------------------- entry points


def _as_packed(q: Tensor, cu_seqlens: Tensor | None) -> tuple[list[int], int]:
    """The sequence lengths of the [B, T] token grid (one host read of cu_seqlens when given: a CPU copy of
    cu_seqlens spares CUDA callers the device sync)."""
    batch, total = q.shape[:2]
    if cu_seqlens is None:
        return [total] * batch, batch
    if batch != 1:
        raise ValueError(f"chunk_gated_delta_rule: with cu_seqlens the inputs must be packed as B=1, got B={batch}")
    bounds = [int(c) for c in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={total}, got {bounds}")
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])], len(bounds) - 1


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> None:
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2] or v.shape[2] % q.shape[2]:
        raise ValueError(f"q, k must be [B, T, H, Dk] and v [B, T, HV, Dv] with HV a multiple of H (value head j "
                         f"reads key head j // (HV / H)); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    per_channel = g.shape == (*v.shape[:3], q.shape[3])  # KDA's gate: one decay per key channel (kda_rule.py)
    if (g.shape != v.shape[:3] and not per_channel) or beta.shape != v.shape[:3]:
        raise ValueError(f"g must be [B, T, HV] = {tuple(v.shape[:3])} (or [B, T, HV, Dk] per key channel) and beta "
                         f"[B, T, HV]; got {tuple(g.shape)}, {tuple(beta.shape)}")


def _to_value_heads(x: Tensor, value_heads: int) -> Tensor:
    """q or k [B, T, H, D] repeated to the value heads (value head j reads key head j // (HV / H))."""
    return x if x.shape[2] == value_heads else x.repeat_interleave(value_heads // x.shape[2], dim=2)


def _no_tokens(v, initial_state, state_shape, acc, output_final_state):
    final = (torch.zeros(state_shape, dtype=acc, device=v.device) if initial_state is None
             else initial_state.to(acc))
    return v.new_zeros(v.shape), (final if output_final_state else None)


def _torch_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                terms=chunk_terms, outputs=chunk_outputs):
    """The project's chunked rule; `terms` and `outputs` are the compiled functions on CUDA."""
    _check_shapes(q, k, v, g, beta)
    q, k = _to_value_heads(q, v.shape[2]), _to_value_heads(k, v.shape[2])
    lengths, num_seqs = _as_packed(q, cu_seqlens)
    batch, seq_len, heads, dim_k = q.shape
    dim_v = v.shape[-1]
    acc = torch.promote_types(v.dtype, torch.float32)  # bf16/fp16 inputs accumulate in fp32
    layout = plan_chunks(tuple(lengths), chunk_size, q.device)
    if layout.num_chunks == 0:  # no tokens at all: the states pass through
        return _no_tokens(v, initial_state, (num_seqs, heads, dim_k, dim_v), acc, output_final_state)
    flat = lambda x: x.reshape(batch * seq_len, *x.shape[2:])  # noqa: E731
    qc, kc, vc = (_to_chunks(flat(x), layout, acc) for x in (q, k, v))
    qc = qc * scale
    gc, bc = (_to_chunks(flat(x), layout, acc) for x in (g, beta))
    o_intra, q_eff, *recurrence = terms(qc, kc, vc, gc, bc)
    if initial_state is None:
        state = torch.zeros(num_seqs, heads, dim_k, dim_v, dtype=acc, device=q.device)
    else:
        if initial_state.shape != (num_seqs, heads, dim_k, dim_v):
            raise ValueError(f"initial_state must be [N, H, Dk, Dv] = {(num_seqs, heads, dim_k, dim_v)}, got "
                             f"{tuple(initial_state.shape)}")
        state = initial_state.to(acc).index_select(0, layout.order)
    entering, final_sorted = _scan_states(*recurrence, state, layout)
    out = outputs(o_intra, q_eff, entering)  # [num_chunks, H, C, Dv]
    out = out.transpose(1, 2).reshape(-1, heads, dim_v).index_select(0, layout.slot_of_token)
    out = out.reshape(batch, seq_len, heads, dim_v).to(v.dtype)
    if not output_final_state:
        return out, None
    final = torch.empty_like(final_sorted).index_copy(0, layout.order, final_sorted)
    return out, final


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                               scale: float | None = None, initial_state: Tensor | None = None,
                               output_final_state: bool = False, cu_seqlens: Tensor | None = None,
                               chunk_size: int = 64) -> tuple[Tensor, Tensor | None]:
    """The token-by-token recurrence (same API, `chunk_size` ignored): the reference the chunked rule is tested
    against. Slow: one step per token."""
    _check_shapes(q, k, v, g, beta)
    q, k = _to_value_heads(q, v.shape[2]), _to_value_heads(k, v.shape[2])
    lengths, num_seqs = _as_packed(q, cu_seqlens)
    batch, _, heads, dim_k = q.shape
    dim_v = v.shape[-1]
    acc = torch.promote_types(v.dtype, torch.float32)
    scale = dim_k ** -0.5 if scale is None else scale
    flat = [x.reshape(-1, *x.shape[2:]).to(acc) for x in (q, k, v, g, beta)]
    outs, finals, start = [], [], 0
    for n, length in enumerate(lengths):
        state = (torch.zeros(heads, dim_k, dim_v, dtype=acc, device=q.device) if initial_state is None
                 else initial_state[n].to(acc))
        for t in range(start, start + length):
            q_t, k_t, v_t, g_t, b_t = (x[t] for x in flat)
            state = state * g_t.exp()[:, None, None]
            delta = b_t[:, None] * (v_t - torch.einsum("hkv,hk->hv", state, k_t))
            state = state + k_t[:, :, None] * delta[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", state, q_t * scale))
        finals.append(state)
        start += length
    out = torch.stack(outs).reshape(batch, -1, heads, dim_v).to(v.dtype)
    return out, (torch.stack(finals) if output_final_state else None)


# ------------------------------------------------------------------------------------------------- dispatch


@dataclass(frozen=True)
class KernelChoice:
    """The implementation `chunk_gated_delta_rule` runs, and why (logged once)."""

    # "torch" (eager chunked rule), "compiled" (the same, torch.compile'd), "fla" or "fla-dqkwg" (fla's kernels
    # with the project's chunk_bwd_dqkwg)
    name: str
    reason: str


def _version_tuple(version: str) -> tuple[int, int, int]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if not piece.isdigit() else piece
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def fla_untrusted_reason(capability: tuple[int, int] | None, triton_version: str | None,
                         tilelang_available: bool = False) -> str | None:
    """Why fla's gated backward cannot be used on this GPU and Triton, or None when it can."""
    if capability is None or capability[0] != 9 or triton_version is None or tilelang_available:
        return None
    low, high = _BAD_TRITON_ON_HOPPER
    if low <= _version_tuple(triton_version) < high:
        return (f"flash-linear-attention refuses its gated backward on Hopper (sm_{capability[0]}{capability[1]}) "
                f"with Triton {triton_version} (needs < 3.4 or >= 3.7.1, or tilelang)")
    return None


def choose_kernel(*, device_type: str, capability: tuple[int, int] | None, triton_version: str | None,
                  fla_available: bool, tilelang_available: bool = False, requested: str = "auto") -> KernelChoice:
    """Pure decision: CUDA + fla importable + a Triton fla trusts -> "fla"; CUDA + fla with a Triton fla refuses
    for its gated chunk_bwd_dqkwg -> "fla-dqkwg" (fla's kernels, the project's maths for that step); CUDA without
    fla -> "compiled"; CPU -> "torch".

    `requested` forces a choice ("torch" anywhere; "compiled", "fla" and "fla-dqkwg" on CUDA only, the fla ones
    only when importable).
    """
    if requested not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV} must be one of {KERNEL_CHOICES}, not {requested!r}")
    if requested == "torch":
        return KernelChoice("torch", "requested")
    if device_type != "cuda":
        if requested != "auto":
            raise ValueError(f"{KERNEL_ENV}={requested} needs CUDA tensors; on {device_type} only 'torch' runs "
                             f"(unset {KERNEL_ENV} or set it to torch)")
        return KernelChoice("torch", f"{device_type} tensors: the eager chunked rule")
    if requested in ("fla", "fla-dqkwg"):
        if not fla_available:
            raise ValueError(f"{KERNEL_ENV}={requested} but flash-linear-attention is not importable "
                             "(pip install fla-core, or set it to compiled)")
        return KernelChoice(requested, "requested")
    if requested == "compiled":
        return KernelChoice("compiled", "requested")
    if not fla_available:
        return KernelChoice("compiled", "flash-linear-attention is not installed")
    untrusted = fla_untrusted_reason(capability, triton_version, tilelang_available)
    if untrusted is not None:
        return KernelChoice("fla-dqkwg", f"fla's kernels with the project's chunk_bwd_dqkwg: {untrusted}")
    return KernelChoice("fla", "flash-linear-attention installed and trusted")


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def _choice_for(device_type: str, device_index: int | None, requested: str) -> KernelChoice:
    capability = triton_version = None
    if device_type == "cuda":
        capability = torch.cuda.get_device_capability(device_index)
        if _installed("triton"):
            import triton

            triton_version = triton.__version__
    choice = choose_kernel(device_type=device_type, capability=capability, triton_version=triton_version,
                           fla_available=device_type == "cuda" and _installed("fla"),
                           tilelang_available=_installed("tilelang"), requested=requested)
    # fallbacks and substitutions reach the ranks' output (WARNING); the plain choices are INFO
    log = logger.warning if choice.name in ("compiled", "fla-dqkwg") and requested == "auto" else logger.info
    log("gated delta rule on %s: %s (%s)", device_type, choice.name, choice.reason)
    return choice


def active_kernel(device: torch.device) -> KernelChoice:
    """The implementation used for tensors on `device` in this process."""
    requested = KERNEL_OVERRIDE or os.environ.get(KERNEL_ENV) or "auto"
    return _choice_for(device.type, device.index, requested)


def compile_chunk_functions(*functions) -> tuple:
    """`functions` (of tensors whose dim 0 is the chunk count) compiled for CUDA, the chunk count dynamic."""
    # One graph per grad mode and head shape: stay clear of the default limit of 8.
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 32)
    # Only the chunk count is dynamic (marked by _dynamic_chunks). With dynamic=True every size is symbolic and
    # equal sizes share a symbol, so a chunk count equal to the head dim (128 chunks, Dk = 128) was guarded on
    # and the next packing recompiled (36 s on an H200).
    return tuple(_dynamic_chunks(torch.compile(fn, fullgraph=True)) for fn in functions)


@functools.lru_cache(maxsize=None)
def _compiled() -> tuple:
    """chunk_terms and chunk_outputs compiled for CUDA (built on first use; never on CPU)."""
    return compile_chunk_functions(chunk_terms, chunk_outputs)


def _dynamic_chunks(compiled):
    @functools.wraps(compiled)
    def call(*tensors: Tensor):
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(*tensors)

    return call


def _fla_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
    """flash-linear-attention's chunk_gated_delta_rule (key heads not repeated: fla groups the value heads)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

    extra = {"chunk_size": chunk_size} if chunk_size in FLA_CHUNK_SIZES else {}  # fla's sizes; same maths
    if cu_seqlens is not None:
        if not cu_seqlens.is_cuda:  # fla reads a host copy instead of syncing with the device
            extra["cu_seqlens_cpu"] = cu_seqlens.long()
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.long)
    out, final = fla_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens, **extra)
    return out, (final.float() if final is not None else None)


def _reference_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
    return _torch_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)


@functools.lru_cache(maxsize=None)
def _fla_dqkwg_refusal(device: torch.device, key_heads: int, value_heads: int, dim_k: int, dim_v: int,
                       dtypes: tuple[torch.dtype, ...], chunk_size: int) -> str | None:
    """None where fla's kernels with the project's chunk_bwd_dqkwg agree with the project's rule at this head shape
    and these dtypes (checked once per process, one log line), else why they are not used."""
    fla_backend.install()
    fla_backend.set_enabled(True)
    shape = f"{key_heads} key / {value_heads} value heads of {dim_k} / {dim_v}, {', '.join(map(str, dtypes))}"
    try:
        result = fla_backend.agreement(_fla_rule, _reference_rule, key_heads=key_heads, value_heads=value_heads,
                                       dim_k=dim_k, dim_v=dim_v, dtypes=dtypes, device=device, tokens=CHECK_TOKENS,
                                       chunk_size=chunk_size if chunk_size in FLA_CHUNK_SIZES else 64)
    except Exception as err:  # noqa: BLE001 - fla that cannot run here leaves the compiled rule, said once
        reason = f"fla's path failed its first-use check ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
    else:
        if result.passed:
            logger.info("gated delta rule on %s: fla-dqkwg agrees with the project's rule at %s (%s)",
                        device, shape, result.describe())
            return None
        reason = f"fla-dqkwg disagrees with the project's rule: {result.describe()}"
    logger.warning("gated delta rule on %s at %s: %s; the compiled rule runs instead", device, shape, reason)
    return reason


def fla_dqkwg_refusal(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64) -> str | None:
    """Why "fla-dqkwg" does not run for inputs shaped like these (its first-use check refused it), or None."""
    return _fla_dqkwg_refusal(q.device, q.shape[2], v.shape[2], q.shape[3], v.shape[3],
                              (q.dtype, v.dtype, g.dtype, beta.dtype), chunk_size)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                           scale: float | None = None, initial_state: Tensor | None = None,
                           output_final_state: bool = False, cu_seqlens: Tensor | None = None,
                           chunk_size: int = 64) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule over q, k [B, T, H, Dk] (l2-normalised), v [B, T, HV, Dv] (HV a multiple of H: value
    head j reads key head j // (HV / H)), g [B, T, HV] (log decay, <= 0) and beta [B, T, HV]; returns (o [B, T, HV,
    Dv] in v's dtype, the final states [N, HV, Dk, Dv] in fp32 (fp64 for fp64 inputs) or None). With `cu_seqlens`
    (B = 1) the state restarts at every sequence start, from zero or `initial_state[i]`. Differentiable in q, k, v,
    g, beta and initial_state.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    choice = active_kernel(q.device).name
    args = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    if choice in ("fla", "fla-dqkwg"):
        _check_shapes(q, k, v, g, beta)
    if choice == "fla-dqkwg":
        if fla_dqkwg_refusal(q, k, v, g, beta, chunk_size) is None:
            fla_backend.set_enabled(True)
            return _fla_rule(q, k, v, g, beta, **args)
        choice = "compiled"
    if choice == "fla":
        fla_backend.set_enabled(False)  # fla's own kernels throughout
        return _fla_rule(q, k, v, g, beta, **args)
    terms, outputs = _compiled() if choice == "compiled" and q.is_cuda else (chunk_terms, chunk_outputs)
    return _torch_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                       terms=terms, outputs=outputs)
