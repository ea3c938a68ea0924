"""A tensor that refuses host reads: the tests of code that must not sync the GPU give it their cu_seqlens."""
from __future__ import annotations

import torch


class HostReadForbidden(torch.Tensor):
    """cu_seqlens as a GPU tensor looks to code that must not sync: any host read raises."""

    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.numpy, torch.Tensor.cpu}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.READS:
            raise AssertionError(f"host read of a device tensor: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})
