"""Which of torch's Adam kernels runs inside megatron's optimizer.

Without TransformerEngine or Apex, megatron-core falls back to `torch.optim.AdamW` built with torch's defaults:
on CUDA that is the multi-tensor ("foreach") implementation, a dozen passes over the fp32 main params, moments
and grads (0.28 s of a 1.75 s Qwen3-30B-A3B-shaped step on one H200). torch's fused AdamW computes the same
update (decoupled weight decay, bias correction, eps outside the square root) in one pass per tensor group.

`use_fused_adam` switches the optimizer megatron built, in place: every param group's kernel flags and every
state's `step` (the fused kernel reads it on the parameter's device; the foreach kernel keeps it on the host). A
loaded checkpoint brings its own groups' flags and host-side steps, so the choice is applied again after every
`load_state_dict`. The training step picks the fused kernel on CUDA; elsewhere nothing changes.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from slime.backends.megatron_utils.offload import torch_optimizers

# The kernel chosen for each torch optimizer, read again by its load_state_dict hook.
_CHOSEN: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = weakref.WeakKeyDictionary()


def fused_adam_chosen(device: torch.device) -> bool:
    """The fused kernel where the parameters live on a GPU; CPU runs keep torch's default."""
    return device.type == "cuda"


def use_fused_adam(optimizer: Any, fused: bool) -> int:
    """Run megatron's (possibly chained) optimizer with torch's fused AdamW kernel (`fused`) or torch's default
    one. Returns how many torch Adam optimizers were switched."""
    switched = 0
    for inner in torch_optimizers(optimizer):
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        if fused:
            _check_fusable(inner)
        if inner not in _CHOSEN:
            inner.register_load_state_dict_post_hook(_reapply)
        _CHOSEN[inner] = fused
        _set_kernel(inner, fused)
        switched += 1
    return switched


def adam_kernel_in_use(optimizer: Any) -> str:
    """"fused", "default" or "mixed": the kernel flags of the optimizer's torch Adam groups."""
    kinds = {"fused" if group.get("fused") else "default"
             for inner in torch_optimizers(optimizer) for group in inner.param_groups}
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "none")


def _check_fusable(inner: torch.optim.Optimizer) -> None:
    for group in inner.param_groups:
        for p in group["params"]:
            if not p.is_floating_point() or p.device.type not in ("cuda", "cpu"):
                raise ValueError(f"torch's fused AdamW needs floating-point CUDA or CPU parameters, got a "
                                 f"{p.dtype} parameter on {p.device}")
        if group.get("differentiable"):
            raise ValueError("torch's fused AdamW does not support differentiable=True")


def _set_kernel(inner: torch.optim.Optimizer, fused: bool) -> None:
    for group in inner.param_groups:
        group["fused"] = True if fused else None  # None, None: torch's own choice, as megatron built it
        group["foreach"] = False if fused else None
    for param, state in inner.state.items():
        step = state.get("step")
        if torch.is_tensor(step):  # one tensor per parameter: a loaded state may share one among all
            device = param.device if fused else torch.device("cpu")
            state["step"] = step.detach().to(device=device, dtype=torch.float32 if fused else step.dtype,
                                              copy=True)


def _reapply(inner: torch.optim.Optimizer) -> None:
    _set_kernel(inner, _CHOSEN[inner])
