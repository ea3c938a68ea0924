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
    return torch.matmul((s - lse.unsqueeze(-1)).exp(), _wide(v)).to(q.dtype), lse, ()


def _math_backward(grad, q, k, v, out, lse, causal, scale, state):
    p = (_scores(q, k, causal, scale) - lse.unsqueeze(-1)).exp()
    g = _wide(grad)
    dp = torch.matmul(g, _wide(v).transpose(-1, -2))
    ds = p * (dp - (g * _wide(out)).sum(-1, keepdim=True)) * scale
    dq, dk, dv = torch.matmul(ds, _wide(k)), torch.matmul(ds.transpose(-1, -2), _wide(q)), torch.matmul(p.transpose(-1, -2), g)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


CUDNN = LseKernel("cudnn", _cudnn_forward, _cudnn_backward, grouped_kv=True)
FLASH = LseKernel("flash", _flash_forward, _flash_backward)
MATH = LseKernel("math", _math_forward, _math_backward)


def flash_usable(q: torch.Tensor) -> bool:
    """torch's flash kernels: CUDA, fp16/bf16, head dim a multiple of 8 up to 256."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


def cudnn_usable(q: torch.Tensor) -> bool:
    """cuDNN's fused attention: where flash serves, on Hopper or later with cuDNN loaded, head dim up to 128 (the
    widths measured; wider heads keep torch's flash)."""
    return (flash_usable(q) and q.shape[-1] <= 128 and torch.backends.cudnn.is_available()
            and torch.cuda.get_device_capability(q.device) >= (9, 0))


def lse_kernel_for(q: torch.Tensor) -> LseKernel:
    """The kernel prefix_attention runs by default: cuDNN where usable, else torch's flash."""
    return CUDNN if cudnn_usable(q) else FLASH


class _PrefixAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, kernel):
        past = k.shape[2] - q.shape[2]
        o_past, l_past, s_past = kernel.forward(q, k[:, :, :past], v[:, :, :past], False, scale)
        o_own, l_own, s_own = kernel.forward(q, k[:, :, past:], v[:, :, past:], True, scale)
        lse = torch.logaddexp(l_past, l_own)
        merged = (_wide(o_past) * (l_past - lse).exp().unsqueeze(-1)
                  + _wide(o_own) * (l_own - lse).exp().unsqueeze(-1))
        out = torch.empty_like(o_own)  # the kernel's own output layout, which its backward expects
        out.copy_(merged)
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
    first = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731 - [t, h, d] -> [1, h, t, d], a view
    out = _PrefixAttention.apply(first(q), first(k), first(v), scale, kernel)
    return out.squeeze(0).transpose(0, 1)
