"""The project's chunk_bwd_dqkwg plugged into flash-linear-attention, and the check that fla's path agrees with the
project's rule before a process trusts it.

fla 0.6 routes `chunk_bwd_dqkwg` (fla/ops/common/chunk_o.py) through its backend registry (`fla.backends`):
the first registered backend that is enabled and whose verifier accepts the call computes it, else fla's own
Triton kernel runs, which refuses the gated case on Hopper with Triton >= 3.4 and < 3.7.1. Registering the
project's maths (gated_delta_bwd.py) there keeps every other kernel of fla's forward and backward. The backend
is registered once per process and switched on and off with the kernel choice (gated_delta_rule.py), so a
process that forces fla's own path gets fla's own kernel.

fla has shipped wrong gradients in exactly this Triton range more than once, so before the first use of a head
shape and dtype `agreement` runs fla's path (with this backend) and the project's chunked rule on a small packed
batch of that shape, forward and backward, and reports the largest difference of each result relative to its
size; the caller uses fla only where every one is within tolerance.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from slime.models import gated_delta_bwd

BACKEND_TYPE = "slime"
# Relative agreement (max abs difference over max abs value) asked of fla's path against the fp32 rule: bf16
# rounding of fla's intermediates stays ~1e-2; the miscompiles this guards against are off by ~50 %.
TOLERANCE = {torch.float32: 1e-2, torch.float64: 1e-2, torch.bfloat16: 0.1, torch.float16: 0.1}
_enabled = False


def unsupported_reason(q: Tensor, k: Tensor, v: Tensor, w: Tensor | None, g: Tensor | None,
                       g_gamma: Tensor | None, dv: Tensor | None) -> str | None:
    """Why the project's maths does not take this chunk_bwd_dqkwg call (fla's own kernel then runs), or None."""
    if g is None:
        return "no per-token gate: fla's own kernel is sound there"
    if g_gamma is not None:
        return "a per-head constant gate (g_gamma) is not covered"
    if w is None or dv is None:
        return "only the delta rule's call (with w and dv) is covered"
    if v.shape[2] % k.shape[2]:
        return f"{v.shape[2]} value heads are not a multiple of {k.shape[2]} key heads"
    return None


def set_enabled(enabled: bool) -> None:
    """Route fla's gated chunk_bwd_dqkwg to the project's maths (True) or to fla's own kernel (False)."""
    global _enabled
    _enabled = enabled


def enabled() -> bool:
    return _enabled


@functools.lru_cache(maxsize=None)
def install() -> None:
    """Register the backend with fla (once per process; it stays off until `set_enabled(True)`)."""
    import fla.ops.common.chunk_o  # noqa: F401  (creates fla's 'common' registry and loads its own backends)
    from fla.backends import BaseBackend, register

    class ProjectDqkwg(BaseBackend):
        backend_type = BACKEND_TYPE
        priority = 1  # before tilelang (5): when switched on, this process chose the project's maths

        @classmethod
        def is_available(cls) -> bool:
            return True

        def is_enabled(self) -> bool:
            return _enabled

        def chunk_bwd_dqkwg_verifier(self, q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None,
                                     *args, **kwargs) -> tuple[bool, str | None]:
            reason = unsupported_reason(q, k, v, w, g, g_gamma, dv)
            return reason is None, reason

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            return gated_delta_bwd.chunk_bwd_dqkwg(*args, **kwargs)

    register("common")(ProjectDqkwg)


@dataclass(frozen=True)
class Agreement:
    """fla's path against the project's rule on one small batch: relative max difference per result."""

    errors: dict[str, float]
    tolerance: float

    @property
    def passed(self) -> bool:
        return all(math.isfinite(e) and e <= self.tolerance for e in self.errors.values())

    def describe(self) -> str:
        worst = max(self.errors, key=lambda n: self.errors[n] if math.isfinite(self.errors[n]) else math.inf)
        listed = ", ".join(f"{n} {e:.1e}" for n, e in self.errors.items())
        return f"largest relative difference {self.errors[worst]:.1e} ({worst}; tolerance {self.tolerance:g}): {listed}"


Rule = Callable[..., tuple[Tensor, Tensor]]


def agreement(fla_rule: Rule, reference: Rule, *, key_heads: int, value_heads: int, dim_k: int, dim_v: int,
              dtypes: tuple[torch.dtype, ...], chunk_size: int, device: torch.device, tokens: int) -> Agreement:
    """Run `fla_rule` and `reference` (both chunk_gated_delta_rule's signature, key heads not repeated) on about
    `tokens` tokens of this head shape packed as three sequences (partial chunks, one shorter than a chunk);
    q/k, v, g, beta in `dtypes`. fla tunes its kernels on their first call, so `tokens` should be a training size."""
    q_dtype, v_dtype, g_dtype, beta_dtype = dtypes
    lengths = (tokens // 2 + 9, tokens // 2 - 5, chunk_size - 3)
    total = sum(lengths)
    gen = torch.Generator(device=device).manual_seed(1234)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    def unit(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    inputs = {"q": unit(randn(1, total, key_heads, dim_k)).to(q_dtype),
              "k": unit(randn(1, total, key_heads, dim_k)).to(q_dtype),
              "v": randn(1, total, value_heads, dim_v).to(v_dtype),
              "g": (-torch.nn.functional.softplus(randn(1, total, value_heads) - 2.0)).to(g_dtype),
              "beta": randn(1, total, value_heads).sigmoid().to(beta_dtype),
              "initial_state": randn(len(lengths), value_heads, dim_k, dim_v) * 0.1}
    cu_seqlens = torch.tensor([0, lengths[0], lengths[0] + lengths[1], total], dtype=torch.int32)  # host: no sync
    d_out, d_final = randn(1, total, value_heads, dim_v), randn(len(lengths), value_heads, dim_k, dim_v)

    def run(rule: Rule, widen: bool) -> dict[str, Tensor]:
        leaves = {n: (x.float() if widen else x).detach().requires_grad_() for n, x in inputs.items()}
        out, final = rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                          scale=dim_k ** -0.5, initial_state=leaves["initial_state"], output_final_state=True,
                          cu_seqlens=cu_seqlens, chunk_size=chunk_size)
        loss = (out.float() * d_out).sum() + (final.float() * d_final).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
        return {"out": out.detach(), "final_state": final.detach(),
                **{f"d{n}": g for n, g in zip(leaves, grads)}}

    with torch.inference_mode(False), torch.enable_grad():
        got, want = run(fla_rule, widen=False), run(reference, widen=True)
    errors = {n: ((got[n].double() - want[n].double()).abs().max()
                  / want[n].double().abs().max().clamp_min(1e-12)).item() for n in want}
    return Agreement(errors, max(TOLERANCE.get(d, 1e-2) for d in dtypes))
