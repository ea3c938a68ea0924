"""Compiled elementwise kernels of the local layer spec: RMSNorm and RoPE, and the switch that picks them.

Without TransformerEngine every norm and rotary embedding is a chain of eager kernels, each reading and
writing the whole [tokens, hidden] activation (fp32 upcasts included). Compiled with torch.compile (Triton
on CUDA), each becomes one kernel forward and one backward, with the same maths. With the fused head, a
Qwen3-0.6B-shaped step on one H200 goes from 258 to 364 TFLOP/s (benchmarks/RESULTS.md).

The choice (`--fused-kernels`) is made once at start-up by `configure()` and is the same on every rank:
- "compile": these functions, megatron's compiled SwiGLU and the fused log-prob/entropy head
  (slime/backends/megatron_utils/logprob_head.py) run compiled;
- "eager": the same functions uncompiled, megatron's unfused SwiGLU, the loss's unfused head: the
  reference the compiled path is tested against (tests/test_fused_kernels.py), and the CPU default;
- "auto": "compile" on CUDA with Triton importable, else "eager".
No collective runs inside a compiled function, so the choice never changes a rank's collective sequence.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

FUSED_KERNEL_CHOICES = ("auto", "compile", "eager")
RECOMPILE_LIMIT = 64
_state = {"impl": "eager"}


def resolve(choice: str, device_type: str) -> str:
    """"compile" or "eager" for `--fused-kernels choice` on a machine whose device is `device_type`."""
    if choice not in FUSED_KERNEL_CHOICES:
        raise ValueError(f"--fused-kernels must be one of {FUSED_KERNEL_CHOICES}, not {choice!r}")
    if choice != "auto":
        return choice
    if device_type != "cuda":
        return "eager"  # inductor's CPU kernels need a C++ toolchain and minutes of compile time per shape set
    try:
        import triton  # noqa: F401
    except ImportError:
        return "eager"
    return "compile"


def configure(impl: str) -> None:
    """Select "compile" or "eager" for every kernel of this module (and the log-prob head) in this process."""
    if impl not in ("compile", "eager"):
        raise ValueError(f"fused kernel implementation must be 'compile' or 'eager', not {impl!r}")
    if impl == "compile":
        # A norm has up to ~8 graphs (hidden and head-dim weights, with and without grad, the views it is
        # handed): at torch's default limit of 8 the rest would silently run eager.
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        # Float arguments (eps, 1/temperature, mscale) are fixed for a run: as constants. Left dynamic,
        # each becomes a 0-d CPU tensor input, whose C++ kernel makes every fresh process build and load
        # inductor's CPU vector-ISA probes (about 35 of a warm start's 41 s on one H200).
        config.specialize_float = True
    _state["impl"] = impl


def active() -> str:
    """The implementation selected in this process: "compile" or "eager"."""
    return _state["impl"]


def compiled_or_eager(fn: Callable) -> Callable:
    """`fn` compiled (dynamic shapes: packed batches change length every micro-batch) when "compile" is
    active, `fn` itself otherwise. The compiled version is built on first use."""

    @functools.cache
    def compiled() -> Callable:
        return torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def dispatch(*args, **kwargs):
        return compiled()(*args, **kwargs) if _state["impl"] == "compile" else fn(*args, **kwargs)

    return dispatch


# The compiled functions see contiguous inputs of one rank only: every distinct rank, size-1 dimension or
# stride pattern would be a graph of its own (a norm's [t, 1, h] hidden states, its [t, heads, d] query and
# key views of the fused QKV output), and past torch's recompile limit calls fall back to eager.
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen/Llama RMSNorm over the last dimension: normalise in fp32, cast back to the input's dtype, then scale."""
    return _rms_norm_rows(x.reshape(-1, x.size(-1)), weight, eps).view(x.shape)


@compiled_or_eager
def _rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(input_dtype)


def rms_norm_zero_centered(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3-Next / Qwen3.5 RMSNorm (zero-centred weight): normalise and scale by 1 + weight in fp32, then cast."""
    return _rms_norm_zero_centered_rows(x.reshape(-1, x.size(-1)), weight, eps).view(x.shape)


@compiled_or_eager
def _rms_norm_zero_centered_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def rotary_bshd(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, rotary_interleaved: bool,
                multi_latent_attention: bool, mscale: float) -> torch.Tensor:
    """megatron's rotate-half RoPE on THD tokens `t` [t, h, d]: frequency rows `positions` of `freqs`
    [max_s, 1, 1, rot_dim] (the gather, cos/sin and rotation fused when compiled)."""
    return _rotary_tokens(t.contiguous(), freqs, positions, rotary_interleaved, multi_latent_attention, mscale)


@compiled_or_eager
def _rotary_tokens(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, rotary_interleaved: bool,
                   multi_latent_attention: bool, mscale: float) -> torch.Tensor:
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1), freqs.index_select(0, positions), rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention, mscale=mscale,
    ).squeeze(1)
