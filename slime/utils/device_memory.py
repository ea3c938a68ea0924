"""Device memory of this process, as the colocate metrics report it.

`allocated`/`reserved` are PyTorch's caching-allocator counters (tensors; tensors + cached blocks).
`process` is what the driver says this process holds on the device (NVML): it also counts the CUDA
context and communicator buffers, which no sleep can free, so the metrics report them apart as
`process - reserved`. On a machine without CUDA every figure is 0 and `process` is None.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

_GIB = float(1 << 30)


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    allocated: int
    reserved: int
    peak_reserved: int
    """Highest `reserved` since the last peak reset (the wake, for the trainer)."""
    process: int | None
    """NVML's figure for this process (None where NVML cannot see it)."""

    def gigabytes(self) -> dict[str, float]:
        values = {"allocated_gb": self.allocated / _GIB, "reserved_gb": self.reserved / _GIB,
                  "peak_reserved_gb": self.peak_reserved / _GIB}
        if self.process is not None:
            values["process_gb"] = self.process / _GIB
            values["context_and_comm_gb"] = max(0, self.process - self.reserved) / _GIB
        return values

    def metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}_{key}": value for key, value in self.gigabytes().items()}


def sample_device_memory(device: torch.device | str | None = None) -> DeviceMemory:
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return DeviceMemory(allocated=0, reserved=0, peak_reserved=0, process=None)
    return DeviceMemory(allocated=torch.cuda.memory_allocated(device), reserved=torch.cuda.memory_reserved(device),
                        peak_reserved=torch.cuda.max_memory_reserved(device), process=_nvml_process_bytes(device))


def _nvml_process_bytes(device: torch.device) -> int | None:
    """This process's device memory according to the driver, or None (no NVML, or pids not visible)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(_physical_index(device))
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except pynvml.NVMLError:
        return None
    return None


def _physical_index(device: torch.device) -> int:
    """NVML counts physical GPUs; torch counts the visible ones."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if index < len(ids) and ids[index].isdigit():
            return int(ids[index])
    return index
