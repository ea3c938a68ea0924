"""SGLang's colocated tensor payload (`load_format="flattened_bucket"`), written and read without SGLang.

A bucket's tensors are flattened into one uint8 tensor; the payload is the pickle (torch's
ForkingPickler, base64 for JSON) of `{"flattened_tensor": flat, "metadata": [entry, ...]}`, each entry
saying where one named tensor lies in `flat`: name, shape, dtype, start_idx, end_idx, numel (bytes).
On CUDA the flat tensor travels as a CUDA-IPC handle: the receiver maps the sender's memory, no copy
through the host. torch refcounts each serialized handle once, so every consumer (engine x TP rank)
needs its own serialization, and the sender keeps `flat` alive until the consumer answered.

`encode_ipc_payload` writes it as SGLang's decoder reads it (attribute names of SGLang's
FlattenedTensorMetadata; the device by UUID, as SGLang's patched reduction sends it). `decode_payload`
reads this project's payloads and SGLang's own through `slime.utils.tensor_unpickler` (nothing but
tensor-rebuild functions and the entry record is ever resolved) and checks every entry against `flat`.
"""
from __future__ import annotations

import base64
import binascii
import io
import math
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing.reductions as reductions

from slime.utils.tensor_unpickler import RefusedGlobalError, rebuild_cuda_tensor_on_device_uuid, restricted_loads

LOAD_FORMAT = "flattened_bucket"
NamedTensors = list[tuple[str, torch.Tensor]]
_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
_DEVICE_ARG = 6  # storage_device in torch's reduce_tensor arguments for a CUDA tensor


class BucketPayloadError(ValueError):
    """A flattened-bucket payload that is not what SGLang's format says."""


@dataclass
class BucketEntry:
    """Where one named tensor lies in the flattened bucket (bytes); SGLang's FlattenedTensorMetadata fields."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def __setstate__(self, state: Any) -> None:
        """Unpickling sets exactly these fields, each of its type (a payload can carry nothing else)."""
        if not isinstance(state, dict) or set(state) != set(_FIELDS):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise BucketPayloadError(f"a bucket entry has exactly the fields {_FIELDS}, got {got}")
        shape = state["shape"]
        if not isinstance(state["name"], str) or not isinstance(state["dtype"], torch.dtype) \
                or not isinstance(shape, tuple) or not all(_is_int(d) and d >= 0 for d in shape) \
                or not all(_is_int(state[k]) for k in ("start_idx", "end_idx", "numel")):
            raise BucketPayloadError(f"bucket entry {state.get('name')!r}: a field has the wrong type")
        self.__dict__.update(state, shape=torch.Size(shape))


ENTRY_RECORDS = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): BucketEntry,
    (__name__, "BucketEntry"): BucketEntry,
}
"""The record classes a payload may name: SGLang's metadata class is read as this project's entry."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def visible_device_uuids() -> list[str]:
    """The UUIDs of the GPUs this process sees: a CUDA-IPC sender reaches it only on one of these."""
    return [device_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []


# ----------------------------------------------------------------------------- writing
def flatten(named_tensors: NamedTensors) -> tuple[torch.Tensor, list[BucketEntry]]:
    """One uint8 tensor holding every tensor's bytes in order, and the entries that locate them."""
    if not named_tensors:
        raise ValueError("a flattened bucket needs at least one tensor")
    pieces, entries, start = [], [], 0
    for name, tensor in named_tensors:
        piece = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        entries.append(BucketEntry(name, tensor.shape, tensor.dtype, start, start + piece.numel(), piece.numel()))
        pieces.append(piece)
        start += piece.numel()
    return torch.cat(pieces), entries


class _DeviceUuidPickler(ForkingPickler):
    """ForkingPickler whose CUDA tensors name their device by UUID (the receiver may number GPUs otherwise)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            _, args = reductions.reduce_tensor(obj)
            uuid = device_uuid(torch.device("cuda", args[_DEVICE_ARG]))
            return rebuild_cuda_tensor_on_device_uuid, (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1:])
        return NotImplemented


def serialize(flat: torch.Tensor, entries: list[BucketEntry]) -> str:
    """One consumer's payload (base64 text for JSON): call once per consumer, keep `flat` alive until it answered."""
    buffer = io.BytesIO()
    _DeviceUuidPickler(buffer).dump({"flattened_tensor": flat, "metadata": entries})
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def encode_ipc_payload(named_tensors: NamedTensors, consumers: int = 1) -> tuple[torch.Tensor, tuple[str, ...]]:
    """The flat tensor (to keep alive while the consumers read it) and one serialization per consumer."""
    flat, entries = flatten(named_tensors)
    return flat, tuple(serialize(flat, entries) for _ in range(consumers))


# ----------------------------------------------------------------------------- reading
def decode_payload(blob: str | bytes) -> NamedTensors:
    """The named tensors of one payload: views of the (mapped) flat tensor, each checked against it."""
    try:
        raw = base64.b64decode(blob, validate=True) if isinstance(blob, str) else bytes(blob)
    except (binascii.Error, ValueError) as exc:
        raise BucketPayloadError(f"a flattened-bucket payload is base64 text: {exc}") from None
    try:
        data = restricted_loads(raw, ENTRY_RECORDS)
    except RefusedGlobalError:
        raise
    except (pickle.UnpicklingError, EOFError, RuntimeError) as exc:  # truncated, or a handle that does not open
        raise BucketPayloadError(f"could not read the flattened-bucket payload: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict) or set(data) != {"flattened_tensor", "metadata"}:
        raise BucketPayloadError("a flattened-bucket payload is a dict of 'flattened_tensor' and 'metadata'")
    flat, entries = data["flattened_tensor"], data["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise BucketPayloadError("'flattened_tensor' must be a 1-D uint8 tensor")
    if not isinstance(entries, list) or not all(isinstance(e, BucketEntry) for e in entries):
        raise BucketPayloadError("'metadata' must be a list of bucket entries")
    return [(entry.name, _view(flat, entry)) for entry in entries]


def _view(flat: torch.Tensor, entry: BucketEntry) -> torch.Tensor:
    nbytes = math.prod(entry.shape) * entry.dtype.itemsize
    if not (0 <= entry.start_idx <= entry.end_idx <= flat.numel()) or entry.end_idx - entry.start_idx != nbytes \
            or entry.numel != nbytes:
        raise BucketPayloadError(f"bucket entry {entry.name!r}: bytes [{entry.start_idx}, {entry.end_idx}) "
                                 f"(numel {entry.numel}) do not hold a {entry.dtype} tensor of shape "
                                 f"{tuple(entry.shape)} inside the {flat.numel()}-byte bucket")
    piece = flat[entry.start_idx:entry.end_idx]
    if (flat.storage_offset() + entry.start_idx) % entry.dtype.itemsize:
        piece = piece.clone()  # a typed view needs an aligned start (SGLang's packing never misaligns)
    return piece.view(entry.dtype).view(entry.shape)
