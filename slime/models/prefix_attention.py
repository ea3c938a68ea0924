"""Causal attention of a query chunk against a longer key prefix, lower-right aligned (the chunk's last query sees
every key), as two calls of a kernel that returns its log-sum-exp, merged.

A CP rank's second zig-zag chunk attends to a key prefix longer than itself. SDPA has no fast kernel for that
lower-right mask (torch sends `causal_lower_right` to the memory-efficient kernel), while a square causal call and
an unmasked call both run on flash kernels. So: the chunk against the keys before it (no mask) and against its own
keys (square, causal), each with its log-sum-exp, the outputs weighted by exp(lse_part - lse_total). The backward is
each part's kernel backward given the merged output and log-sum-exp (the rule ring attention uses), so nothing
beyond q, k, v, the output and the log-sum-exp is kept.

Kernels: `CUDNN` (cuDNN's fused attention through torch's aten op, CUDA fp16/bf16, GQA in the kernel: on Hopper the
fastest for both parts), `FLASH` (torch's flash-attention ops, CUDA fp16/bf16, k/v heads repeated for GQA) and `MATH`
(explicit fp32 scores: the reference the tests compare the merge against, on any device). `lse_kernel_for` picks one.

`chunk_pair_attention` does a CP rank's two zig-zag chunks of one sequence at once: both chunks' own causal squares
(the same length) as ONE batched call, each chunk's past (the keys before it, if any) as an unmasked call, merged per
chunk. On a CP2 rank that is two kernel calls each way instead of three, and no copies of q or k/v (strided views).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class LseKernel:
    """forward(q, k, v, causal, scale) -> (out, lse, state); backward(grad, q, k, v, out, lse, causal, scale, state)
    -> (dq, dk, dv). Tensors [b, h, t, d] with as many k/v heads as q heads; lse fp32 [b, h, tq]."""

    name: str
    forward: Callable
    backward: Callable
    grouped_kv: bool = False
    """True: the kernel takes fewer k/v heads than q heads (GQA) itself; else k/v are repeated for it."""
    usable: Callable[[torch.Tensor], bool] = lambda q: True
    """Whether the kernel serves these queries (device, dtype, head dim)."""


def _flash_forward(q, k, v, causal, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(grad, q, k, v, out, lse, causal, scale, state):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)


def _cudnn_forward(q, k, v, causal, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    # cuDNN keeps its statistics as [b, h, tq, 1]: the merge wants [b, h, tq], the backward the kernel's own shape
    return out, lse.view(out.shape[:-1]), (cum_q, cum_k, max_q, max_k, seed, offset, lse.shape)


def _cudnn_backward(grad, q, k, v, out, lse, causal, scale, state):
    cum_q, cum_k, max_q, max_k, seed, offset, lse_shape = state
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse.reshape(lse_shape), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal,
        scale=scale)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """fp32 at least (fp64 stays fp64: the tests' reference precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _scores(q, k, causal, scale):
    s = torch.matmul(_wide(q), _wide(k).transpose(-1, -2)) * scale
    if causal:  # square: query i sees keys <= i
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale):
    s = _scores(q, k, causal, scale)
    lse = s.logsumexp(-1)
    out = torch.empty_like(q)  # in q's layout, as cuDNN's: the CPU tests take the views the GPU path takes
    return out.copy_(torch.matmul((s - lse.unsqueeze(-1)).exp(), _wide(v))), lse, ()


def _math_backward(grad, q, k, v, out, lse, causal, scale, state):
    p = (_scores(q, k, causal, scale) - lse.unsqueeze(-1)).exp()
    g = _wide(grad)
    dp = torch.matmul(g, _wide(v).transpose(-1, -2))
    ds = p * (dp - (g * _wide(out)).sum(-1, keepdim=True)) * scale
    dq, dk, dv = torch.matmul(ds, _wide(k)), torch.matmul(ds.transpose(-1, -2), _wide(q)), torch.matmul(p.transpose(-1, -2), g)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def flash_usable(q: torch.Tensor) -> bool:
    """torch's flash kernels: CUDA, fp16/bf16, head dim a multiple of 8 up to 256."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


def cudnn_usable(q: torch.Tensor) -> bool:
    """cuDNN's fused attention: where flash serves, on Hopper or later with cuDNN loaded, head dim up to 128 (the
    widths measured; wider heads keep torch's flash)."""
    return (flash_usable(q) and q.shape[-1] <= 128 and torch.backends.cudnn.is_available()
            and torch.cuda.get_device_capability(q.device) >= (9, 0))


CUDNN = LseKernel("cudnn", _cudnn_forward, _cudnn_backward, grouped_kv=True, usable=cudnn_usable)
FLASH = LseKernel("flash", _flash_forward, _flash_backward, usable=flash_usable)
MATH = LseKernel("math", _math_forward, _math_backward)


def lse_kernel_for(q: torch.Tensor) -> LseKernel:
    """The kernel prefix_attention runs by default: cuDNN where usable, else torch's flash."""
    return CUDNN if cudnn_usable(q) else FLASH


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[t, h, d] -> [1, h, t, d] (a view: the attention kernels read [t, h, d] natively)."""
    return x.transpose(0, 1).unsqueeze(0)


class _PrefixAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, kernel):
        past = k.shape[2] - q.shape[2]
        o_past, l_past, s_past = kernel.forward(q, k[:, :, :past], v[:, :, :past], False, scale)
        # merged in place: the own call's output keeps the kernel's layout, which its backward expects
        out, lse, s_own = kernel.forward(q, k[:, :, past:], v[:, :, past:], True, scale)
        _merge_into(out, lse, o_past, l_past)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.states, ctx.scale, ctx.kernel = (s_past, s_own), scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        grad = torch.empty_like(out).copy_(grad)  # the output's layout (the kernel's backward assumes it)
        past = k.shape[2] - q.shape[2]
        s_past, s_own = ctx.states
        dq_past, dk_past, dv_past = ctx.kernel.backward(grad, q, k[:, :, :past], v[:, :, :past], out, lse, False,
                                                        ctx.scale, s_past)
        dq_own, dk_own, dv_own = ctx.kernel.backward(grad, q, k[:, :, past:], v[:, :, past:], out, lse, True,
                                                     ctx.scale, s_own)
        return dq_past + dq_own, _cat_keys(dk_past, dk_own), _cat_keys(dv_past, dv_own), None, None


def _cat_keys(past: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """[1, h, t, d] key gradients joined along t, in the token-major memory of the [t, h, d] keys they belong to
    (where the kernels wrote them so: two block copies, not a transposing one)."""
    tokens_first = lambda x: x.squeeze(0).transpose(0, 1)  # noqa: E731 - a view
    return torch.cat([tokens_first(past), tokens_first(own)]).transpose(0, 1).unsqueeze(0)


def prefix_attention(q, k, v, *, scale: float, kernel: LseKernel | None = None) -> torch.Tensor:
    """q [tq, hq, d] against k/v [tk, hkv, d] with tk > tq, causal aligned lower-right -> [tq, hq, d]. GQA by
    repeating k/v (autograd sums their gradients back over the groups). `kernel`: lse_kernel_for(q) by default."""
    kernel = kernel or lse_kernel_for(q)
    if k.shape[0] <= q.shape[0]:
        raise ValueError(f"prefix_attention needs a key prefix longer than the queries, got {k.shape[0]} <= {q.shape[0]}")
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not kernel.grouped_kv:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = _PrefixAttention.apply(heads_first(q), heads_first(k), heads_first(v), scale, kernel)
    return out.squeeze(0).transpose(0, 1)


# ------------------------------------------------------------------------------ both zig-zag chunks at once
def _kernel_ready(x: torch.Tensor) -> torch.Tensor:
    """x itself where a fused kernel reads its strides (unit last stride; the others, and the offset, multiples of 8
    elements: 16-byte aligned rows for fp16/bf16), else a contiguous copy."""
    strides = [s for n, s in zip(x.shape[:-1], x.stride()[:-1]) if n > 1] + [x.storage_offset()]
    return x if x.stride(-1) == 1 and all(s % 8 == 0 for s in strides) else x.contiguous()


def _pair(x: torch.Tensor) -> torch.Tensor:
    """[2 * half, h, d] -> [2, h, half, d], the two chunks as a batch (a view)."""
    return x.view(2, x.shape[0] // 2, *x.shape[1:]).transpose(1, 2)


def _own_keys(x: torch.Tensor, first_end: int, half: int) -> torch.Tensor:
    """The chunks' own keys x[first_end - half:first_end] and x[-half:] of x [tk, h, d] as [2, h, half, d]: one
    strided view (its batch stride spans the keys from one chunk to the other), copied only where a kernel would
    not read it."""
    rows, heads, dims = x.stride()
    view = x.as_strided((2, x.shape[1], half, x.shape[2]), ((x.shape[0] - first_end) * rows, heads, rows, dims),
                        x.storage_offset() + (first_end - half) * rows)
    return _kernel_ready(view)


def _pasts(first_end: int, tk: int, half: int) -> tuple[tuple[int, int], ...]:
    """(chunk, number of keys before its own) of the chunks that have such keys: the second always, the first
    on every CP rank but the first."""
    return tuple((c, end - half) for c, end in ((0, first_end), (1, tk)) if end > half)


def _merge_into(own: torch.Tensor, own_lse: torch.Tensor, past: torch.Tensor, past_lse: torch.Tensor) -> None:
    """own <- both parts' outputs weighted by exp(lse_part - lse), own_lse <- lse = logaddexp of both: the weights
    and the sum in the lse's precision (fp32 at least), written into own in its dtype, with one wide temporary."""
    lse = torch.logaddexp(past_lse, own_lse)
    weighted_past = past * (past_lse - lse).exp().unsqueeze(-1)
    torch.addcmul(weighted_past, own, (own_lse - lse).exp().unsqueeze(-1), out=own)
    own_lse.copy_(lse)


def _key_grad(own: torch.Tensor, past: dict[int, torch.Tensor], first_end: int) -> torch.Tensor:
    """The keys' gradient [tk, h, d] from the parts' ones (own [2, h, half, d], past: chunk -> [h, past, d]): the
    second chunk's past and own keys tile all tk keys; the first chunk's keys lie within that past."""
    tokens = lambda x: x.transpose(0, 1)  # noqa: E731 - [h, t, d] -> [t, h, d], a view
    half = own.shape[2]
    grad = torch.cat([tokens(past[1]), tokens(own[1])])
    grad[first_end - half:first_end] += tokens(own[0])
    if 0 in past:
        grad[:first_end - half] += tokens(past[0])
    return grad


class _ChunkPairAttention(torch.autograd.Function):
    """chunk_pair_attention: one batched causal call for both chunks' own keys, one unmasked call per chunk with
    keys before it, merged per chunk; the backward likewise, given the merged output and lse (as _PrefixAttention)."""

    @staticmethod
    def forward(ctx, q, k, v, first_end, scale, kernel):
        half = q.shape[0] // 2
        q2 = _kernel_ready(_pair(q))
        out2, lse, own_state = kernel.forward(q2, _own_keys(k, first_end, half), _own_keys(v, first_end, half),
                                              True, scale)
        states = [own_state]
        for c, past in _pasts(first_end, k.shape[0], half):
            o_past, l_past, state = kernel.forward(q2[c:c + 1], heads_first(k[:past]), heads_first(v[:past]),
                                                   False, scale)
            _merge_into(out2[c], lse[c], o_past[0], l_past[0])
            states.append(state)
        out = out2.transpose(1, 2).reshape(q.shape)  # a view where the kernel wrote q's layout (cuDNN, flash)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.first_end, ctx.scale, ctx.kernel, ctx.states = first_end, scale, kernel, states
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        first_end, scale, kernel = ctx.first_end, ctx.scale, ctx.kernel
        half = q.shape[0] // 2
        q2, out2, grad2 = _kernel_ready(_pair(q)), _pair(out), _pair(grad)
        if grad2.stride() != out2.stride():  # the kernels' backward reads the gradient in the output's layout
            grad2 = torch.empty_like(out2).copy_(grad2)
        dq, dk_own, dv_own = kernel.backward(grad2, q2, _own_keys(k, first_end, half), _own_keys(v, first_end, half),
                                             out2, lse, True, scale, ctx.states[0])
        dk_past, dv_past = {}, {}
        for (c, past), state in zip(_pasts(first_end, k.shape[0], half), ctx.states[1:]):
            one = slice(c, c + 1)
            dq_c, dk_c, dv_c = kernel.backward(grad2[one], q2[one], heads_first(k[:past]), heads_first(v[:past]),
                                               out2[one], lse[one], False, scale, state)
            dq[c] += dq_c[0]
            dk_past[c], dv_past[c] = dk_c[0], dv_c[0]
        return (dq.transpose(1, 2).reshape(q.shape), _key_grad(dk_own, dk_past, first_end),
                _key_grad(dv_own, dv_past, first_end), None, None, None)


def chunk_pair_attention(q, k, v, first_end: int, *, scale: float, kernel: LseKernel | None = None) -> torch.Tensor:
    """A CP rank's two zig-zag chunks of one sequence, q [2 * half, hq, d] (the first chunk, then the second),
    against the sequence's keys k/v [tk, hkv, d] in global order up to the second chunk's end: the first chunk
    attends to k[:first_end], the second to all of k, each causal aligned lower-right -> [2 * half, hq, d]. GQA and
    `kernel` as prefix_attention."""
    kernel = kernel or lse_kernel_for(q)
    half = q.shape[0] // 2
    if q.shape[0] % 2 or not half <= first_end <= k.shape[0] - half:
        raise ValueError(f"chunk_pair_attention needs two chunks of equal length, the first ending (at key "
                         f"{first_end}) before the second's keys start, got {q.shape[0]} queries, {k.shape[0]} keys")
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not kernel.grouped_kv:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return _ChunkPairAttention.apply(q, k, v, first_end, scale, kernel)
