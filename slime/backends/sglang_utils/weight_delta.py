"""Delta weight pushes (`--update-weight-mode delta`): what changed since the engines' weights, bit for bit.

Both ends read this module: the trainer's sender encodes, the embedded engine applies and verifies.
A tensor's delta is the flat positions whose bit pattern changed and, per position, either the XOR of
old and new bits (`xor`: smallest, must be applied exactly once) or the new bits (`overwrite`:
idempotent), as upstream slime's two encodings. Both work on the integer view of the tensor's bytes,
so applying is exact (no arithmetic on floats, no drift).

Every delta carries a digest of the tensor it must produce (`--update-weight-delta-checksum`): the
engine applies into a copy, compares the digest, and loads nothing if any tensor of the bucket differs
(its weights were not the sender's baseline, e.g. it restarted); the sender then pushes that bucket in full.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from slime.config.constants import DELTA_ENCODINGS, DELTA_LOAD_FORMAT
from slime.utils.checksums import hexdigest

LOAD_FORMAT = DELTA_LOAD_FORMAT
MISMATCH = "delta checksum mismatch"  # how an engine's refusal begins (the sender then pushes in full)
ENCODINGS = DELTA_ENCODINGS
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def digest(tensor: torch.Tensor, checksum: str) -> str:
    """Hex digest of the tensor's bytes (C order, on the host)."""
    return hexdigest(tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes(), checksum)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(_BITS[tensor.element_size()])


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


@dataclass(frozen=True)
class TensorDelta:
    """One tensor's delta: positions (flat, ascending) and values in the tensor's integer view."""

    positions: torch.Tensor
    values: torch.Tensor
    digest: str

    @property
    def nbytes(self) -> int:
        return self.positions.numel() * self.positions.element_size() + self.values.numel() * self.values.element_size()


def encode(new: torch.Tensor, base: torch.Tensor, encoding: str, checksum: str) -> TensorDelta:
    """The delta turning `base` into `new` (same shape and dtype)."""
    if new.shape != base.shape or new.dtype != base.dtype:
        raise ValueError(f"delta of {tuple(new.shape)} {new.dtype} against {tuple(base.shape)} {base.dtype}")
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding {encoding!r}; expected one of {ENCODINGS}")
    new_bits, base_bits = _bits(new), _bits(base.to(new.device))
    positions = torch.nonzero(new_bits != base_bits).reshape(-1)
    values = new_bits[positions] if encoding == "overwrite" else new_bits[positions] ^ base_bits[positions]
    return TensorDelta(positions.to(index_dtype(new.numel())), values, digest(new, checksum))


def apply(current: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, encoding: str) -> torch.Tensor:
    """A new tensor: `current` with the delta applied (current itself is left as it is)."""
    bits = _bits(current).clone()
    where = positions.to(device=bits.device, dtype=torch.int64)
    values = values.to(bits.device).view(bits.dtype)
    bits[where] = values if encoding == "overwrite" else bits[where] ^ values
    return bits.view(current.dtype).reshape(current.shape)


def value_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype a tensor of `dtype` travels as in a delta."""
    return _BITS[torch.empty((), dtype=dtype).element_size()]


def wire_spec(name: str, tensor: torch.Tensor, delta: TensorDelta) -> dict:
    """What the engine needs to receive and check one tensor's delta (the HTTP body's entry)."""
    return {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "changed": int(delta.positions.numel()), "digest": delta.digest}
