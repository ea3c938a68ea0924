"""Core attention with context parallelism and packed (THD) batches, in pure torch.

A drop-in for megatron's `DotProductAttention` in the local layer spec (which supports neither
CP nor packed sequences; only TransformerEngine does). Same maths on CPU and GPU.

Layout convention (shared with slime/backends/megatron_utils/data.py):
- Each sequence of padded length L (L divisible by 2*cp) is split into 2*cp equal chunks;
  CP rank r holds chunks r and 2*cp-1-r, concatenated (zig-zag, balances causal work).
- A packed batch concatenates each sequence's local part; `PackedSeqParams.cu_seqlens_q`
  (or `cu_seqlens_q_padded` when set) holds cumulative FULL padded lengths, so the local
  length of sequence i is (cu[i+1]-cu[i]) / cp.
- Without packing ([s, b, ...]) each batch element is one sequence of length s*cp.

K/V are all-gathered over the CP group (backward: reduce-scatter of their grads); each query
attends to keys of its own sequence at global positions <= its own.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions (within its sequence) of the tokens CP rank `cp_rank` holds."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"sequence length {seq_len} not divisible by 2*cp={2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_chunk = 2 * cp_size - 1 - cp_rank
    second = torch.arange(second_chunk * chunk, (second_chunk + 1) * chunk)
    return torch.cat([first, second])


@functools.lru_cache(maxsize=64)
def _sequence_index_plan(seq_lens: tuple[int, ...], cp_size: int, cp_rank: int, device: torch.device):
    """Per sequence: (local slice, gathered-key indices, query positions, key positions).

    Gathered keys are laid out rank-major: [rank 0's local tokens, rank 1's, ...]. Cached
    (on `device`) because every layer of a micro-batch asks for the same plan.
    """
    local_lens = [length // cp_size for length in seq_lens]
    local_total = sum(local_lens)
    plan = []
    offset = 0
    for length, local_len in zip(seq_lens, local_lens):
        key_index = torch.cat(
            [torch.arange(j * local_total + offset, j * local_total + offset + local_len)
             for j in range(cp_size)]
        )
        key_pos = torch.cat([zigzag_positions(length, cp_size, j) for j in range(cp_size)])
        query_pos = zigzag_positions(length, cp_size, cp_rank)
        plan.append((slice(offset, offset + local_len), key_index.to(device),
                     query_pos.to(device), key_pos.to(device)))
        offset += local_len
    return tuple(plan)


class _AllGatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward reduce-scatters (sums) the grads."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        tensor = tensor.contiguous()
        out = torch.empty((world * tensor.shape[0], *tensor.shape[1:]),
                          dtype=tensor.dtype, device=tensor.device)
        dist.all_gather_into_tensor(out, tensor, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = torch.empty((grad.shape[0] // world, *grad.shape[1:]),
                          dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


def _attend(q, k, v, query_pos, key_pos, scale: float, dropout_p: float) -> torch.Tensor:
    """q [tq, hq, d], k/v [tk, hkv, d] -> [tq, hq, d], causal by global position, GQA."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # query head h uses kv group h // groups (megatron and HF agree)
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    allowed = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=allowed,
        dropout_p=dropout_p,
        scale=scale,
    )
    return out.squeeze(0).transpose(0, 1)


class ContextParallelAttention(MegatronModule):
    """Core attention (after QKV projection and RoPE) supporting CP, THD packing and GQA."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        **unused,
    ):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"ContextParallelAttention is causal only, got {attn_mask_type}")
        self.layer_number = max(1, layer_number)
        self.attention_dropout = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        if softmax_scale is None:
            softmax_scale = getattr(config, "softmax_scale", None)
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None

    def _cp_group(self) -> Optional[dist.ProcessGroup]:
        if self.config.context_parallel_size == 1:
            return None
        return self.cp_group or parallel_state.get_context_parallel_group()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None or attention_mask is not None:
            # The mask is derived from positions and sequence boundaries; an explicit one
            # (e.g. padding) would be silently different, so refuse it.
            raise ValueError("explicit attention_mask/attention_bias are not supported")
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        group = self._cp_group()
        cp_size = 1 if group is None else dist.get_world_size(group)
        cp_rank = 0 if group is None else dist.get_rank(group)
        if packed:
            # [t, heads, d]; cu_seqlens are the FULL padded sequence boundaries.
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            seq_lens = tuple((cu[1:] - cu[:-1]).tolist())
            out = self._attend_packed(query, key, value, seq_lens, group, cp_size, cp_rank)
            return out.reshape(out.shape[0], -1)
        # [s, b, heads, d]: every batch element is one sequence of length s*cp.
        s, b = query.shape[:2]
        fold = lambda x: x.transpose(0, 1).reshape(b * s, *x.shape[2:])
        out = self._attend_packed(fold(query), fold(key), fold(value),
                                  (s * cp_size,) * b, group, cp_size, cp_rank)
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _attend_packed(self, q, k, v, seq_lens, group, cp_size, cp_rank) -> torch.Tensor:
        if group is not None:
            # One collective for K and V together; identical on every CP rank of the group.
            kv = _AllGatherSequence.apply(torch.cat([k, v], dim=-1), group)
            k, v = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        plan = _sequence_index_plan(seq_lens, cp_size, cp_rank, q.device)
        dropout_p = self.attention_dropout if self.training else 0.0
        outputs = []
        with self._dropout_rng():
            for local, key_index, query_pos, key_pos in plan:
                outputs.append(_attend(
                    q[local], k.index_select(0, key_index), v.index_select(0, key_index),
                    query_pos, key_pos, self.softmax_scale, dropout_p,
                ))
        return torch.cat(outputs, dim=0)

    def _dropout_rng(self):
        # Heads are split over TP, so attention dropout draws from the TP-rank RNG stream
        # (as megatron's DotProductAttention does) unless SP already decorrelates ranks.
        if self.attention_dropout > 0 and self.training and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()
