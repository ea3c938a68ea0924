"""tensor_digest.py's row sums as one Triton kernel (CUDA): a program per row of words reads them once and mixes
them in uint32 arithmetic, which wraps mod 2^32 as the digest's definition does. Imported only where Triton is."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slime.backends.sglang_utils.tensor_digest import _LANES


@triton.jit
def _mixed(words, index, position_factor: tl.constexpr, offset: tl.constexpr, first: tl.constexpr,
           second: tl.constexpr):
    x = words ^ (index * tl.full((), position_factor, tl.uint32) + tl.full((), offset, tl.uint32))
    x = x * tl.full((), first, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), second, tl.uint32)
    return x ^ (x >> 13)


@triton.jit
def _row_lanes_kernel(rows, first_word, valid_words, out, ROW: tl.constexpr, A0: tl.constexpr, B0: tl.constexpr,
                      C0: tl.constexpr, D0: tl.constexpr, A1: tl.constexpr, B1: tl.constexpr, C1: tl.constexpr,
                      D1: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, ROW)
    words = tl.load(rows + row * ROW + columns).to(tl.uint32, bitcast=True)
    index = (tl.load(first_word + row) + columns).to(tl.uint32)  # the word's index in its tensor, mod 2^32
    valid = columns < tl.load(valid_words + row)
    lane0 = tl.where(valid, _mixed(words, index, A0, B0, C0, D0), 0).to(tl.uint64)
    lane1 = tl.where(valid, _mixed(words, index, A1, B1, C1, D1), 0).to(tl.uint64)
    tl.store(out + 2 * row, tl.sum(lane0, axis=0).to(tl.int64, bitcast=True))
    tl.store(out + 2 * row + 1, tl.sum(lane1, axis=0).to(tl.int64, bitcast=True))


def row_lanes(rows: torch.Tensor, first_word: torch.Tensor, valid_words: torch.Tensor) -> torch.Tensor:
    """[R, 2] int64 lane sums of the [R, ROW] int32 words (tensor_digest._row_lanes' contract)."""
    out = torch.empty(rows.shape[0], 2, dtype=torch.int64, device=rows.device)
    (a0, b0, c0, d0), (a1, b1, c1, d1) = _LANES
    _row_lanes_kernel[(rows.shape[0],)](rows, first_word, valid_words, out, ROW=rows.shape[1], A0=a0, B0=b0, C0=c0,
                                        D0=d0, A1=a1, B1=b1, C1=c1, D1=d1)
    return out
