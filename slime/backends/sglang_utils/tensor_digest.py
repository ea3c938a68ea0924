"""A digest of a tensor's bytes, computed where the tensor lives: the weight-sync proof's unit of comparison.

Both ends read this module: the embedded engine digests every tensor it serves, the trainer every tensor it
pushes, each in the dtype the engine holds it, and the two must be equal (backends/weight_sync/proof.py).

The digest of a tensor is a function of its dtype and bytes alone (not of its device, its strides or the
other tensors digested with it). Its bytes, zero-padded to whole 32-bit words w_0 .. w_{n-1} (little-endian),
give two lanes L = 0, 1:

    lane_L = (sum_j mix_L(w_j XOR position_L(j)) + nbytes * K) mod 2^64

where position_L is an affine function of the word's index and mix_L an invertible xor-shift-multiply on
32 bits. A change of one word changes its mixed value and so each lane (no collision is possible); changes
of several words cancel in both lanes with a chance of about 2^-64. Every intermediate value stays below 2^63,
so the integer arithmetic is exact on every device (no overflow), and the sums do not depend on the order of
the additions: a CPU and a GPU agree bit for bit.

Cost: on CUDA the per-word maths and the row sums are one Triton kernel reading each byte once; tensors are
grouped into buffers of up to GROUP_BYTES (one concatenation per group pads every member to whole rows) so one
launch covers many small tensors; only 16 bytes per tensor come back to the host (without Triton, or on another
device, the same maths runs as torch ops, eagerly). On the host (tests, the CPU engine) numpy's wrapping uint32
arithmetic computes the same sums.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

ROW_WORDS = 1024  # words per row of the digest's [rows, ROW_WORDS] view
GROUP_BYTES = 256 * 1024**2  # tensors digested in one call (a larger tensor gets a call of its own)
_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
# (position multiplier, position offset, first multiplier, second multiplier) per lane: odd, below 2^31, so
# every product of a 32-bit value by one of them stays below 2^63
_LANES = ((0x2545F491, 0x3C6EF372, 0x7FEB352D, 0x68E31DA5), (0x5851F42D, 0x1B873593, 0x4CF5AD43, 0x2C1B3C6D))
_LENGTH_FACTOR = 0x9E3779B97F4A7C15


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _mix(words: torch.Tensor, index: torch.Tensor, lane: tuple[int, int, int, int]) -> torch.Tensor:
    position_factor, offset, first, second = lane
    x = words ^ ((index * position_factor + offset) & _MASK32)
    x = (x * first) & _MASK32
    x = x ^ (x >> 15)
    x = (x * second) & _MASK32
    return x ^ (x >> 13)


def _row_lanes(rows: torch.Tensor, first_word: torch.Tensor, valid_words: torch.Tensor) -> torch.Tensor:
    """[R, 2] lane sums of rows of 32-bit words: row r holds words first_word[r] .. of its tensor, of which the
    first valid_words[r] count (the rest is padding)."""
    columns = torch.arange(rows.shape[1], device=rows.device, dtype=torch.int64)
    index = (first_word[:, None] + columns[None, :]) & _MASK32
    words = rows.to(torch.int64) & _MASK32
    valid = columns[None, :] < valid_words[:, None]
    return torch.stack([torch.where(valid, _mix(words, index, lane), 0).sum(dim=1) for lane in _LANES], dim=1)


@functools.cache
def _triton_row_lanes(device: torch.device):
    """tensor_digest_triton.row_lanes (the same sums in one Triton kernel) once it gave the torch maths' sums on
    this device; None without Triton, or (with a warning) when it did not."""
    try:
        from slime.backends.sglang_utils.tensor_digest_triton import row_lanes
    except ImportError:
        return None
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(-2**31, 2**31, (3, ROW_WORDS), generator=generator, dtype=torch.int64).to(torch.int32)
    first = torch.tensor([0, ROW_WORDS, 2**32 - 5], dtype=torch.int64)
    valid = torch.tensor([ROW_WORDS, 17, ROW_WORDS], dtype=torch.int64)
    expected = _row_lanes(rows, first, valid)
    try:
        got = row_lanes(rows.to(device), first.to(device), valid.to(device)).cpu()
    except Exception as exc:  # noqa: BLE001 - a kernel this device cannot build: the torch maths instead
        logger.warning("tensor digest: the Triton kernel failed on %s (%s); digesting with torch ops", device, exc)
        return None
    if not torch.equal(got, expected):
        logger.warning("tensor digest: the Triton kernel's sums differ from the definition's on %s; digesting "
                       "with torch ops", device)
        return None
    return row_lanes


def _row_lanes_on(device: torch.device):
    """Triton's kernel on CUDA when it is installed and checked, else the torch maths (eager)."""
    kernel = _triton_row_lanes(device) if device.type == "cuda" else None
    return kernel or _row_lanes


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return flat if flat.storage_offset() % 4 == 0 else flat.clone()  # whole words of its own storage


ROW_BYTES = ROW_WORDS * 4


@dataclass
class _Group:
    """Tensors digested in one call: their bytes, each padded to whole rows, concatenated once (or, alone, a large
    tensor's row-aligned head, in place); per tensor (or head, or tail) its rows, first word's index and words."""

    parts: list[torch.Tensor] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    start_words: list[int] = field(default_factory=list)
    words: list[int] = field(default_factory=list)
    nbytes: int = 0

    def add(self, position: int, part: torch.Tensor, pad: torch.Tensor | None, start_word: int, nbytes: int) -> None:
        self.parts += [part] if pad is None else [part, pad]
        padded = nbytes + (0 if pad is None else pad.numel())
        self.positions.append(position)
        self.rows.append(padded // ROW_BYTES)
        self.start_words.append(start_word)
        self.words.append(-(-nbytes // 4))
        self.nbytes += padded


def _groups(flats: list[tuple[int, torch.Tensor]], zeros: torch.Tensor) -> list[_Group]:
    """Groups of up to GROUP_BYTES. A tensor over it has its row-aligned head digested in place, alone (no copy),
    and its tail grouped with the tensors after it. A tensor's padding is a slice of `zeros`: no copy of its own,
    the group's one concatenation pads them all."""
    groups = [_Group()]
    for position, flat in flats:
        nbytes = flat.numel()
        head = nbytes // ROW_BYTES * ROW_BYTES if nbytes > GROUP_BYTES else 0
        if head:
            groups.insert(len(groups) - 1, _Group())
            groups[-2].add(position, flat[:head], None, 0, head)
            if head == nbytes:
                continue
        tail = nbytes - head
        pad = -tail % ROW_BYTES if tail else ROW_BYTES  # an empty tensor: one row of padding
        if groups[-1].positions and groups[-1].nbytes + tail + pad > GROUP_BYTES:
            groups.append(_Group())
        groups[-1].add(position, flat[head:] if head else flat, zeros[:pad] if pad else None, head // 4, tail)
    return [group for group in groups if group.positions]


def _group_lanes(group: _Group, device: torch.device) -> list[tuple[int, int]]:
    """The lane sums of each member of a group (one call over all its rows), on the host."""
    data = group.parts[0] if len(group.parts) == 1 else torch.cat(group.parts)
    rows = data.view(torch.int32).view(-1, ROW_WORDS)
    rows_per, start, words = (torch.tensor(v, dtype=torch.int64, device=device) for v in
                              (group.rows, group.start_words, group.words))
    owner = torch.repeat_interleave(torch.arange(len(group.rows), device=device), rows_per, output_size=rows.shape[0])
    local = torch.arange(rows.shape[0], device=device) - (torch.cumsum(rows_per, 0) - rows_per)[owner]
    first = start[owner] + local * ROW_WORDS
    valid = (words[owner] - local * ROW_WORDS).clamp(max=ROW_WORDS)
    lanes = _row_lanes_on(device)(rows, first, valid)
    sums = torch.zeros(len(group.rows), 2, dtype=torch.int64, device=device).index_add_(0, owner, lanes)
    return [tuple(pair) for pair in sums.cpu().tolist()]


HOST_CHUNK_WORDS = 1 << 18  # words per step on the host: the step's buffers stay in the CPU's cache


@functools.cache
def _host_index() -> np.ndarray:
    return np.arange(HOST_CHUNK_WORDS, dtype=np.uint32)


def _host_lanes(flat: torch.Tensor) -> list[int]:
    """The lane sums of a host tensor's bytes, in numpy's uint32 arithmetic (wrapping mod 2^32, as the
    definition), a cache-sized chunk of words at a time into two reused buffers."""
    data = flat.numpy()
    if data.size % 4:
        data = np.concatenate([data, np.zeros(4 - data.size % 4, dtype=np.uint8)])
    words = data.view("<u4")
    x = np.empty(min(words.size, HOST_CHUNK_WORDS), dtype=np.uint32)
    shifted = np.empty_like(x)
    sums = [0, 0]
    with np.errstate(over="ignore"):
        for start in range(0, words.size, HOST_CHUNK_WORDS):
            chunk = words[start:start + HOST_CHUNK_WORDS]
            n = chunk.size
            for lane, (position_factor, offset, first, second) in enumerate(_LANES):
                out, tmp = x[:n], shifted[:n]
                np.multiply(_host_index()[:n], np.uint32(position_factor), out=out)
                out += np.uint32((start * position_factor + offset) & _MASK32)
                out ^= chunk
                out *= np.uint32(first)
                np.right_shift(out, np.uint32(15), out=tmp)
                out ^= tmp
                out *= np.uint32(second)
                np.right_shift(out, np.uint32(13), out=tmp)
                out ^= tmp
                sums[lane] += int(out.sum(dtype=np.uint64))
    return sums


def tensor_digests(tensors: Sequence[torch.Tensor]) -> list[str]:
    """The digest of each tensor, "<dtype>:<32 hex digits>", computed on its own device."""
    flats = [_bytes_of(t) for t in tensors]
    lanes = [_host_lanes(flat) if flat.device.type == "cpu" else None for flat in flats]
    on_devices = [(position, flat) for position, flat in enumerate(flats) if lanes[position] is None]
    for position, pair in _device_lanes(on_devices).items():
        lanes[position] = pair
    return [_format(t.dtype, flat.numel(), lane) for t, flat, lane in zip(tensors, flats, lanes)]


def _device_lanes(flats: list[tuple[int, torch.Tensor]]) -> dict[int, list[int]]:
    """position -> lane sums of tensors on a device: grouped, one row-wise call per group."""
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for position, flat in flats:
        by_device.setdefault(flat.device, []).append((position, flat))
    lanes: dict[int, list[int]] = {}
    for device, members in by_device.items():
        zeros = torch.zeros(ROW_BYTES, dtype=torch.uint8, device=device)
        for group in _groups(members, zeros):
            for position, pair in zip(group.positions, _group_lanes(group, device)):
                held = lanes.setdefault(position, [0, 0])
                held[0] += pair[0]
                held[1] += pair[1]
    return lanes


def tensor_digest(tensor: torch.Tensor) -> str:
    return tensor_digests([tensor])[0]


def _format(dtype: torch.dtype, nbytes: int, lanes: list[int]) -> str:
    hexes = "".join(f"{(lane + nbytes * _LENGTH_FACTOR) & _MASK64:016x}" for lane in lanes)
    return f"{dtype_name(dtype)}:{hexes}"


def digest_dtype(digest: str) -> str:
    """The dtype a digest was taken in ("bfloat16" of "bfloat16:...")."""
    return digest.partition(":")[0]
