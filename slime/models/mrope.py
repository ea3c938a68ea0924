"""Multimodal RoPE (Qwen2-VL's M-RoPE and its successors'): three position rows per token and their rotary angles.

A prompt's text tokens count up as usual on all three rows. An image's tokens (a run of `grid_t x grid_h x grid_w /
merge^2` image tokens) sit on a grid: the temporal row is `start + t`, the height row `start + h`, the width row
`start + w`, for t, h, w over the merged grid in row-major order; the text after the image goes on from `start +
max(grid_h, grid_w) / merge`. This is what transformers' `get_rope_index` of Qwen2.5-VL, Qwen3-VL and Qwen3.5 gives
for images (tests/test_vlm_model.py compares them). Each head's rotary frequency pair takes its angle from one row
(vision_arch.MultimodalRope). Pure torch, no megatron.
"""

from __future__ import annotations

from typing import Sequence

import torch

from slime.models.vision_arch import MultimodalRope


def image_token_counts(grids: torch.Tensor, merge_size: int) -> list[int]:
    """Image tokens of each image of `grids` [images, 3] (temporal, height, width patches)."""
    return [int(t * h * w) // merge_size ** 2 for t, h, w in grids.tolist()]


def position_rows(tokens: Sequence[int], grids: torch.Tensor | None, image_token_id: int, merge_size: int,
                  length: int | None = None) -> torch.Tensor:
    """[3, length] positions of one sequence: `tokens` (image k is the k-th image token run, of image k's count),
    then padding up to `length` continuing the text count. ValueError when the runs do not match the grids."""
    grids = grids if grids is not None else torch.zeros(0, 3, dtype=torch.long)
    counts = image_token_counts(grids, merge_size)
    pieces, start, cursor, image = [], 0, 0, 0
    total = len(tokens)
    while cursor < total:
        if tokens[cursor] == image_token_id and image < len(counts):
            n = counts[image]
            if any(token != image_token_id for token in tokens[cursor:cursor + n]) or cursor + n > total:
                raise ValueError(f"image {image} needs {n} image tokens from position {cursor}, the sequence has "
                                 "fewer there")
            rows = _grid_rows(grids[image], merge_size) + start
            pieces.append(rows)
            start += max(int(grids[image][1]), int(grids[image][2])) // merge_size
            cursor += n
            image += 1
            continue
        end = cursor
        while end < total and not (tokens[end] == image_token_id and image < len(counts)):
            end += 1
        pieces.append(torch.arange(start, start + end - cursor).expand(3, -1))
        start += end - cursor
        cursor = end
    if image != len(counts):
        raise ValueError(f"{len(counts)} image(s) given, the sequence holds the tokens of {image}")
    pad = (length if length is not None else total) - total
    pieces.append(torch.arange(start, start + pad).expand(3, -1))
    return torch.cat(pieces, dim=1).long()


def _grid_rows(grid: torch.Tensor, merge_size: int) -> torch.Tensor:
    t, h, w = int(grid[0]), int(grid[1]) // merge_size, int(grid[2]) // merge_size
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1)


def angles(rows: torch.Tensor, inv_freq: torch.Tensor, rope: MultimodalRope) -> torch.Tensor:
    """[tokens, pairs] rotary angle of each frequency pair (fp32): pair i turns at inv_freq[i] times the position of
    the row that drives it. `rows` [3, tokens]."""
    pairs = inv_freq.numel()
    if sum(rope.section) != pairs:
        raise ValueError(f"multimodal RoPE sections {rope.section} do not cover the {pairs} rotary pairs")
    row_of_pair = _row_of_pair(rope, pairs).to(rows.device)
    positions = rows.float()[row_of_pair]  # [pairs, tokens]
    return (positions * inv_freq.float().to(rows.device).unsqueeze(1)).t()


def _row_of_pair(rope: MultimodalRope, pairs: int) -> torch.Tensor:
    if rope.interleaved:
        row = torch.zeros(pairs, dtype=torch.long)
        for axis in (1, 2):
            row[axis: rope.section[axis] * 3: 3] = axis
        return row
    return torch.cat([torch.full((n,), axis, dtype=torch.long) for axis, n in enumerate(rope.section)])
