"""Colocate sleep/wake of the trainer's memory: what must survive goes to a host copy, the rest is freed.

`TrainerMemory.sleep()` (after the step's closing fence):
  parameters and optimizer state (fp32 main params, Adam moments) are copied to host memory (pinned
  on CUDA) and their device storage is freed with `storage.resize_(0)`; gradient buffers are freed
  without a copy (the next step zeroes them). Storages, not tensors, are the unit: megatron's
  parameters may be views into DDP's contiguous buffers, and freeing the storage keeps every view a
  valid tensor object that points at the same storage again after wake (FSDP frees parameters the
  same way). On CUDA the caching allocator then returns the freed blocks to the driver.
`TrainerMemory.wake()`: storages are re-allocated and refilled from the host copies, bit-exactly.
While asleep, `read_param(param)` serves a parameter's value from its host copy, so the weight
sync reads the trainer's weights without waking it (upstream reads its CPU weight backup the same
way) and nothing is resident twice on a GPU shared with an engine.

Invariant: nothing touches a freed storage. Every entry point of the actor wakes first, or reads
through `read_param`; a view over a freed storage is not bounds-checked by torch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch

from slime.utils.device_memory import DeviceMemory, sample_device_memory


@dataclass(frozen=True, kw_only=True)
class SleepReport:
    """What a sleep freed and what the process still holds on its device."""

    kept_bytes: int
    """Bytes copied to host memory (parameters, optimizer state)."""
    discarded_bytes: int
    """Bytes freed without a copy (gradient buffers)."""
    awake: DeviceMemory
    """The device memory just before the sleep; its peak fields cover the whole awake period."""
    asleep: DeviceMemory
    seconds: float

    def metrics(self, prefix: str = "memory/trainer") -> dict[str, float]:
        gib = float(1 << 30)
        return {
            f"{prefix}_offloaded_gb": self.kept_bytes / gib,
            f"{prefix}_discarded_gb": self.discarded_bytes / gib,
            **self.awake.metrics(f"{prefix}_awake"),
            **self.asleep.metrics(f"{prefix}_asleep"),
            f"{prefix}_sleep_s": self.seconds,
        }


@dataclass
class _HostCopy:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None
    """uint8 copy of the whole storage; None for a storage freed without a copy."""


class TrainerMemory:
    """Sleep/wake of one rank's model and optimizer memory (see module docstring)."""

    def __init__(self, model_chunks: Sequence[torch.nn.Module], optimizer: Any) -> None:
        self._model_chunks = list(model_chunks)
        self._optimizer = optimizer
        self._device = _training_device(model_chunks)
        self._copies: dict[int, _HostCopy] = {}

    def _storages(self) -> tuple[list[torch.UntypedStorage], list[torch.UntypedStorage]]:
        """(kept, discarded) storages, found anew at every sleep: the optimizer creates its state lazily,
        at its first step, after this object exists."""
        kept = _unique_storages(_state_tensors(self._model_chunks, self._optimizer), self._device)
        kept_ids = {id(s) for s in kept}
        discarded = [s for s in _unique_storages(_grad_buffer_tensors(self._model_chunks), self._device)
                     if id(s) not in kept_ids]
        return kept, discarded

    @property
    def asleep(self) -> bool:
        return bool(self._copies)

    @torch.no_grad()
    def sleep(self) -> SleepReport:
        if self.asleep:
            raise RuntimeError("the trainer's memory is already asleep")
        start = time.perf_counter()
        awake = sample_device_memory(self._device)
        for param in _optimizer_params(self._optimizer):  # fp32 main-param grads are rebuilt by the next step
            param.grad = None
        kept, discarded = self._storages()
        for storage in kept:
            self._copies[id(storage)] = _HostCopy(storage, storage.nbytes(), _copy_to_host(storage))
        for storage in discarded:
            self._copies[id(storage)] = _HostCopy(storage, storage.nbytes(), None)
        _synchronize(self._device)  # the host copies are complete before the device memory goes
        for copy in self._copies.values():
            copy.storage.resize_(0)
        _clear_module_caches(self._model_chunks)
        _release_cached(self._device)
        kept = sum(c.nbytes for c in self._copies.values() if c.host is not None)
        return SleepReport(kept_bytes=kept, discarded_bytes=sum(c.nbytes for c in self._copies.values()) - kept,
                           awake=awake, asleep=sample_device_memory(self._device),
                           seconds=time.perf_counter() - start)

    @torch.no_grad()
    def wake(self) -> float:
        """Re-allocate and refill every storage; returns the seconds it took."""
        start = time.perf_counter()
        for copy in self._copies.values():
            copy.storage.resize_(copy.nbytes)
            target = _bytes_view(copy.storage)
            if copy.host is None:
                target.zero_()
            else:
                target.copy_(copy.host, non_blocking=True)
        _synchronize(self._device)
        self._copies.clear()
        _reset_peak(self._device)
        return time.perf_counter() - start

    def release_cached(self) -> None:
        """Give back what the allocator cached while asleep (a weight sync's buckets): the engines take it next."""
        if self.asleep:
            _release_cached(self._device)

    def read_param(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s value on the training device: the live tensor when awake, else a copy of its host backup."""
        if not self.asleep:
            return param.detach()
        copy = self._copies.get(id(param.untyped_storage()))
        if copy is None or copy.host is None:
            raise KeyError(f"no host copy of a parameter of shape {tuple(param.shape)}: it was not offloaded")
        typed = copy.host.view(param.dtype)
        value = torch.as_strided(typed, param.shape, param.stride(), param.storage_offset())
        return value.to(self._device, non_blocking=True)


# ----------------------------------------------------------------------------- what is offloaded
def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):  # DDP / Float16Module wrappers
        chunk = chunk.module
    return chunk


def _state_tensors(model_chunks: Sequence[torch.nn.Module], optimizer: Any) -> Iterator[torch.Tensor]:
    """Everything that must survive a sleep: parameters, module buffers, DDP's param buffers, optimizer state."""
    for chunk in model_chunks:
        module = _unwrap(chunk)
        yield from module.parameters()
        yield from module.buffers()
        for buffer in _ddp_buffers(chunk):
            if buffer.param_data is not None:
                yield buffer.param_data
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def _grad_buffer_tensors(model_chunks: Sequence[torch.nn.Module]) -> Iterator[torch.Tensor]:
    for chunk in model_chunks:
        for buffer in _ddp_buffers(chunk):
            yield buffer.grad_data


def _ddp_buffers(chunk: torch.nn.Module) -> list[Any]:
    # megatron's DistributedDataParallel keeps its contiguous param/grad buffers in two lists (its
    # `buffers` attribute shadows nn.Module.buffers); a plain module has none.
    buffers = getattr(chunk, "buffers", None)
    if callable(buffers):
        return []
    return [*(buffers or []), *(getattr(chunk, "expert_parallel_buffers", None) or [])]


def torch_optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's (possibly chained) optimizer."""
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(part, "optimizer", part)
        if isinstance(inner, torch.optim.Optimizer):
            yield inner


def _optimizer_params(optimizer: Any) -> Iterator[torch.Tensor]:
    """The parameters the optimizers hold, with those of a hybrid CPU optimizer's device part (fp32 copies whose
    gradients it sets anew at every step; its host part keeps its gradients' pinned buffers, set once)."""
    for inner in torch_optimizers(optimizer):
        for part in (inner, getattr(inner, "gpu_optimizer", None)):
            for group in part.param_groups if part is not None else ():
                yield from group["params"]


def _training_device(model_chunks: Sequence[torch.nn.Module]) -> torch.device:
    return next(p.device for chunk in model_chunks for p in chunk.parameters())


def _unique_storages(tensors: Iterable[torch.Tensor], device: torch.device) -> list[torch.UntypedStorage]:
    """Distinct non-empty storages on `device`, in first-seen order (torch keeps one Python object per storage)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if tensor.device == device and storage.nbytes() > 0:
            seen.setdefault(id(storage), storage)
    return list(seen.values())


def _clear_module_caches(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Drop per-module memoised tensors (megatron's RotaryEmbedding.forward is an lru_cache of cos/sin
    tables per sequence length): recomputed on demand, but while cached they pin the allocator's
    segments, which then cannot go back to the driver (seen on an H200: 67 MB of cached tables kept
    4.6 GB reserved through a sleep)."""
    seen: set[type] = set()
    for chunk in model_chunks:
        for module in chunk.modules():
            kind = type(module)
            clear = getattr(getattr(kind, "forward", None), "cache_clear", None)
            if kind not in seen and clear is not None:
                seen.add(kind)
                clear()


# ----------------------------------------------------------------------------- byte moves
def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _copy_to_host(storage: torch.UntypedStorage) -> torch.Tensor:
    pinned = storage.device.type == "cuda"
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
    host.copy_(_bytes_view(storage), non_blocking=pinned)
    return host


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release_cached(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
