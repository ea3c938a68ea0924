"""A restricted unpickler for tensor payloads: it rebuilds tensors and nothing else.

SGLang's colocated weight push (`/update_weights_from_tensor`, `load_format="flattened_bucket"`) is a
pickle made by torch's ForkingPickler: each CUDA tensor travels as a CUDA-IPC handle that
`torch.multiprocessing.reductions.rebuild_cuda_tensor` opens. A plain `pickle.loads` of a request body
would run any callable the body names (`os.system`, `builtins.eval`, ...), so anyone able to reach the
route could run code in the engine. This unpickler resolves a global only from a fixed table:

  - torch's tensor and storage rebuild functions (CUDA IPC, and CPU storages shared by file name),
  - the tensor and storage classes they take, `torch.Size`, `torch.device` and every torch dtype,
  - `rebuild_cuda_tensor_on_device_uuid` below (the device named by its UUID, as SGLang's patched
    reduction and this project's encoder send it; SGLang's own function name maps to it),
  - plain record classes the caller names (e.g. the flattened bucket's metadata), which must validate
    their state themselves.

Every other global, and every persistent id, is refused with `RefusedGlobalError`. Storages shared
through a file descriptor (`rebuild_storage_fd`: torch's default CPU strategy) are refused too: their
handle is a `multiprocessing` connection object, not plain data.
"""
from __future__ import annotations

import io
import pickle
from typing import Any, Mapping

import torch
import torch.multiprocessing.reductions as reductions
import torch.storage

Global = tuple[str, str]

_REBUILD_CUDA_TENSOR = reductions.rebuild_cuda_tensor  # torch's own, whatever patches run later
_DEVICE_ARG = 6  # storage_device in rebuild_cuda_tensor's arguments (torch's reduce_tensor order)


class RefusedGlobalError(pickle.UnpicklingError, ValueError):
    """The payload names a global outside the tensor-rebuild allowlist (a bad request: ValueError too)."""


def cuda_device_of_uuid(device: int | str) -> int:
    """This process's CUDA index of a device given by index or by UUID (processes may see different
    index orders, e.g. under different CUDA_VISIBLE_DEVICES)."""
    if isinstance(device, bool) or not isinstance(device, (int, str)):
        raise pickle.UnpicklingError(f"a CUDA device is an index or a UUID string, not {type(device).__name__}")
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device:
            return index
    raise pickle.UnpicklingError(f"no visible CUDA device has UUID {device}: the sender's GPU is not this "
                                 "process's (CUDA IPC reaches only processes sharing the GPU)")


def rebuild_cuda_tensor_on_device_uuid(*args: Any) -> torch.Tensor:
    """torch's `rebuild_cuda_tensor` with the storage device given by UUID."""
    args = (*args[:_DEVICE_ARG], cuda_device_of_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
    return _REBUILD_CUDA_TENSOR(*args)


def _torch_dtypes() -> dict[Global, Any]:
    return {("torch", name): value for name in dir(torch) if isinstance(value := getattr(torch, name), torch.dtype)}


def _tensor_globals() -> dict[Global, Any]:
    admitted: dict[Global, Any] = {
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _REBUILD_CUDA_TENSOR,
        ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"): reductions.rebuild_storage_filename,
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"): reductions.rebuild_storage_empty,
        (__name__, "rebuild_cuda_tensor_on_device_uuid"): rebuild_cuda_tensor_on_device_uuid,
        # SGLang's device-UUID patch of rebuild_cuda_tensor, as its senders pickle it: same arguments.
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): rebuild_cuda_tensor_on_device_uuid,
        ("torch", "Tensor"): torch.Tensor,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("torch", "UntypedStorage"): torch.UntypedStorage,
        ("torch", "TypedStorage"): torch.TypedStorage,
        ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
        ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
    }
    admitted.update(_torch_dtypes())
    return admitted


_HINTS = {
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"):
        "; CPU storages shared by file descriptor are refused: share them by file name "
        "(torch.multiprocessing.set_sharing_strategy('file_system')) or send CUDA tensors",
    ("torch._utils", "_rebuild_tensor_v2"): "; this is a plain pickle of a tensor (its storage would be read by a "
                                            "nested torch.load): serialize with ForkingPickler",
}

TENSOR_GLOBALS: Mapping[Global, Any] = _tensor_globals()
"""(module, name) -> the object a payload's global resolves to. Nothing outside it is ever imported."""


class TensorUnpickler(pickle.Unpickler):
    """Resolves globals from `TENSOR_GLOBALS` and the caller's `records` only (exact names, no lookup)."""

    def __init__(self, file: io.BufferedIOBase, records: Mapping[Global, type] | None = None) -> None:
        super().__init__(file)
        self._admitted = {**TENSOR_GLOBALS, **(records or {})}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._admitted[(module, name)]
        except KeyError:
            raise RefusedGlobalError(
                f"refused global {module}.{name} in a tensor payload: only torch's tensor-rebuild functions, "
                "torch dtypes/devices/Size and the payload's record types are admitted (a pickle naming other "
                f"globals could run code in this process){_HINTS.get((module, name), '')}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedGlobalError("refused a persistent id in a tensor payload (nothing is loaded by reference)")


def restricted_loads(data: bytes, records: Mapping[Global, type] | None = None) -> Any:
    """`pickle.loads` that rebuilds tensors (and the given record types) and refuses everything else."""
    return TensorUnpickler(io.BytesIO(data), records).load()
