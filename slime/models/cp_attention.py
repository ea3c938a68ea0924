"""Core attention with context parallelism and packed (THD) batches, in pure torch.

A drop-in for megatron's `DotProductAttention` in the local layer spec (which supports neither
CP nor packed sequences; only TransformerEngine does). Same maths on CPU and GPU.

Layout convention (shared with slime/backends/megatron_utils/data.py):
- Each sequence of padded length L (L divisible by 2*cp) is split into 2*cp equal chunks;
  CP rank r holds chunks r and 2*cp-1-r, concatenated (zig-zag, balances causal work).
- A packed batch concatenates each sequence's local part; `PackedSeqParams.cu_seqlens_q`
  (or `cu_seqlens_q_padded` when set) holds cumulative FULL padded lengths, so the local
  length of sequence i is (cu[i+1]-cu[i]) / cp. `PackedSeqParamsWithLengths` also carries
  those lengths as host ints, so no layer has to read them back from the GPU.
- Without packing ([s, b, ...]) each batch element is one sequence of length s*cp.

K/V are all-gathered over the CP group (backward: reduce-scatter of their grads) and put in
each sequence's global order; each query attends to keys of its own sequence at global
positions <= its own. Kernels (`ContextParallelAttention.kernel`):
- "causal" (default): no mask is built. CP1: one causal call per sequence. CP>1: one call per
  zig-zag chunk against its key prefix (the keys up to the chunk's end), causal aligned
  lower-right, i.e. the chunk's last query sees the whole prefix. SDPA with native GQA
  (flash / cuDNN kernels on GPU); with flash-attn importable and fp16/bf16 CUDA inputs, one
  varlen call for the whole micro-batch instead. Where cuDNN's attention serves the inputs (Hopper,
  fp16/bf16, no dropout), a chunk shorter than its key prefix (a CP rank's later chunk) is split into a call
  against the keys before it and a causal square, merged by their log-sum-exp
  (slime/models/prefix_attention.py): SDPA's lower-right mask has no cuDNN path, and its flash path ran at
  290-330 TFLOP/s on a CP2 rank of one H200 against 440-525 for the split. With two chunks a sequence (the
  zig-zag split: every CP size), their causal squares (of equal length) run as one batched call
  (chunk_pair_attention), the chunks' earlier keys as a call each: 516-556 TFLOP/s on those shapes against
  459-522 for the three-call split (`batched=False`).
- "split": "causal" with that split wherever torch's flash or cuDNN kernels serve the inputs.
- "masked": SDPA with an explicit [tq, tk] boolean mask and GQA by repeat_interleave, the
  path before the causal kernels: the reference the causal kernels are tested against, and the "old"
  side of benchmarks/bench_step_gpu.py.

A sliding layer (`window`: Qwen2 / Qwen3 `sliding_attention` layers) runs `attend_windowed` whatever the kernel:
each chunk against the keys its queries can reach, with a band mask (flash-attn's varlen `window_size` on
fp16/bf16 CUDA), under the same zig-zag split and packing.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from slime.models.prefix_attention import (LseKernel, chunk_pair_attention, cudnn_usable, heads_first,
                                             lse_kernel_for, prefix_attention)

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # optional: SDPA's own flash / cuDNN kernels are used instead
    flash_attn_varlen_func = None

KERNELS = ("causal", "split", "masked")


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions (within its sequence) of the tokens CP rank `cp_rank` holds."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"sequence length {seq_len} not divisible by 2*cp={2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_chunk = 2 * cp_size - 1 - cp_rank
    second = torch.arange(second_chunk * chunk, (second_chunk + 1) * chunk)
    return torch.cat([first, second])


@dataclass
class PackedSeqParamsWithLengths(PackedSeqParams):
    """megatron's PackedSeqParams plus the full padded sequence lengths as host ints.

    Every layer needs the lengths on the host (one kernel call per sequence or chunk); reading
    them from the GPU's cu_seqlens would make the host wait for the GPU in every layer.
    """

    padded_lengths: tuple[int, ...] = ()


def packed_seq_params(cu_seqlens: torch.Tensor, padded_lengths: tuple[int, ...]) -> PackedSeqParamsWithLengths:
    """THD params of one packed micro-batch: cu_seqlens (cumulative full padded lengths, on the
    compute device) and the same lengths on the host."""
    longest = max(padded_lengths)
    return PackedSeqParamsWithLengths(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                      max_seqlen_q=longest, max_seqlen_kv=longest,
                                      padded_lengths=tuple(padded_lengths))


def padded_lengths_of(params: PackedSeqParams) -> tuple[int, ...]:
    """Full padded sequence lengths; read back from cu_seqlens (a device sync on GPU) only for
    params built elsewhere."""
    if isinstance(params, PackedSeqParamsWithLengths) and params.padded_lengths:
        return params.padded_lengths
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    return tuple((cu[1:] - cu[:-1]).tolist())


# ------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class SequenceChunks:
    """One sequence of a packed micro-batch, as this CP rank computes its attention."""

    local: slice
    """This rank's tokens of the sequence within the local packed batch."""
    keys: slice
    """The sequence's keys within the key buffer put in global order."""
    query_chunks: tuple[tuple[slice, int], ...]
    """(query tokens within the local batch, length of the key prefix they attend to) per chunk."""


@dataclass(frozen=True)
class AttentionPlan:
    """Index plan of one micro-batch's attention on one CP rank (pure function of the lengths)."""

    sequences: tuple[SequenceChunks, ...]
    key_order: Optional[torch.Tensor]
    """Gathered (rank-major) key index of every key in global order; None without CP."""
    key_order_inverse: Optional[torch.Tensor]
    """Global-order index of every gathered key (key_order's inverse permutation); None without CP."""
    query_positions: tuple[torch.Tensor, ...]
    """Global position of every local query, per sequence (the masked kernel's mask)."""
    varlen_cu_q: torch.Tensor
    """int32 cumulative query lengths, one segment per query chunk (flash-attn varlen)."""
    varlen_cu_k: torch.Tensor
    """int32 cumulative key lengths of the chunks' key prefixes."""
    varlen_key_index: Optional[torch.Tensor]
    """Gathered key index of the concatenated key prefixes; None without CP."""
    max_query_chunk: int
    max_key_prefix: int


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # through pinned memory without blocking: a plain host-to-GPU copy waits for the GPU's queue
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


@functools.lru_cache(maxsize=64)
def attention_plan(lengths: tuple[int, ...], cp_size: int, cp_rank: int, device: torch.device) -> AttentionPlan:
    """The plan of a packed batch of full padded `lengths`. Cached (on `device`): every layer of
    a micro-batch, forward and backward, asks for the same one."""
    local_lens = [length // cp_size for length in lengths]
    local_total = sum(local_lens)
    sequences, orders, positions, segments, varlen_keys = [], [], [], [], []
    offset = 0
    for length, local_len in zip(lengths, local_lens):
        # gathered index of each global position: rank j's local part of this sequence sits at
        # j * local_total + offset, its tokens at the positions zigzag_positions(length, cp, j)
        gathered = torch.arange(length) + offset
        if cp_size > 1:
            for j in range(cp_size):
                gathered[zigzag_positions(length, cp_size, j)] = torch.arange(local_len) + j * local_total + offset
        half = local_len // 2
        if cp_size == 1:
            chunks = ((slice(offset, offset + local_len), length),)
        else:
            second = 2 * cp_size - 1 - cp_rank  # zig-zag chunk index of this rank's second half
            chunks = ((slice(offset, offset + half), (cp_rank + 1) * half),
                      (slice(offset + half, offset + local_len), (second + 1) * half))
        key_start = offset * cp_size  # sequences keep their order in the global-order buffer
        sequences.append(SequenceChunks(local=slice(offset, offset + local_len),
                                        keys=slice(key_start, key_start + length), query_chunks=chunks))
        orders.append(gathered)
        positions.append(zigzag_positions(length, cp_size, cp_rank) if cp_size > 1 else torch.arange(length))
        for queries, prefix in chunks:
            segments.append((queries.stop - queries.start, prefix))
            varlen_keys.append(gathered[:prefix])
        offset += local_len
    cumsum = lambda values: torch.tensor([0, *values], dtype=torch.int64).cumsum(0).to(torch.int32)  # noqa: E731
    to = functools.partial(_to_device, device=device)
    order = torch.cat(orders)
    return AttentionPlan(
        sequences=tuple(sequences),
        key_order=to(order) if cp_size > 1 else None,
        key_order_inverse=to(torch.argsort(order)) if cp_size > 1 else None,
        query_positions=tuple(to(p) for p in positions),
        varlen_cu_q=to(cumsum([q for q, _ in segments])),
        varlen_cu_k=to(cumsum([k for _, k in segments])),
        varlen_key_index=to(torch.cat(varlen_keys)) if cp_size > 1 else None,
        max_query_chunk=max(q for q, _ in segments),
        max_key_prefix=max(k for _, k in segments),
    )


# ------------------------------------------------------------------------------ kernels
def causal_chunk_attention(q, k, v, *, scale: float, dropout_p: float) -> torch.Tensor:
    """q [tq, hq, d] against k/v [tk, hkv, d] (tq <= tk), causal aligned lower-right: query i
    sees keys <= i + tk - tq. GQA without repeating k/v. -> [tq, hq, d]."""
    tq, tk = q.shape[0], k.shape[0]
    square = tq == tk
    out = F.scaled_dot_product_attention(
        heads_first(q), heads_first(k), heads_first(v),
        attn_mask=None if square else lower_right_mask(tq, tk, q.device),
        is_causal=square, dropout_p=dropout_p, scale=scale, enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def lower_right_mask(tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """The lower-right causal mask of tq queries over tk keys. On GPU torch's CausalBias, which picks a kernel that
    takes the variant itself; on CPU the boolean matrix CausalBias materialises there, without its tensor-subclass
    dispatch on every call (about 9 % of a CPU rank's Python time at CP 4)."""
    if device.type != "cpu":
        from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: not at a CPU rank's start

        return causal_lower_right(tq, tk)
    return torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)


def masked_attention(q, k, v, query_pos, key_pos, *, scale: float, dropout_p: float) -> torch.Tensor:
    """q [tq, hq, d], k/v [tk, hkv, d] -> [tq, hq, d] with an explicit mask key_pos <= query_pos
    and GQA by repeat_interleave (query head h uses kv group h // groups, as megatron and HF)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    allowed = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
    out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v),
                                         attn_mask=allowed, dropout_p=dropout_p, scale=scale)
    return out.squeeze(0).transpose(0, 1)


class _Permuted(torch.autograd.Function):
    """x[order] for a permutation `order`: its backward is the gradient gathered by the inverse permutation, not
    an index_add into zeros (a fill and an atomic add per row, 6 % of a CP2 rank's attention on one H200)."""

    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _in_global_order(k, v, plan: AttentionPlan):
    if plan.key_order is None:
        return k, v
    order, inverse = plan.key_order, plan.key_order_inverse
    return _Permuted.apply(k, order, inverse), _Permuted.apply(v, order, inverse)


def _rows(x: torch.Tensor, rows: slice) -> torch.Tensor:
    """x[rows], or x itself where that is all of it (its gradient then needs no zero-filled copy)."""
    return x if rows.start == 0 and rows.stop == x.shape[0] else x[rows]


def attend_causal(q, k, v, plan: AttentionPlan, *, scale: float, dropout_p: float,
                  split: bool | None = None, lse_kernel: LseKernel | None = None, batched: bool = True) -> torch.Tensor:
    """The "causal" kernel: q [t_local, hq, d], k/v gathered over CP (rank-major) -> [t_local, hq, d]. `split`
    (None: where cuDNN serves the inputs) with `lse_kernel` (else lse_kernel_for(q)) where that kernel serves the
    inputs: a sequence's two chunks through chunk_pair_attention (their causal squares as one call), or with
    `batched=False` the later chunk through prefix_attention (three kernel calls a sequence: the benchmark's
    "three-call" path)."""
    if flash_attn_varlen_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return attend_flash_varlen(q, k, v, plan, scale=scale, dropout_p=dropout_p)
    k, v = _in_global_order(k, v, plan)
    kernel = lse_kernel or lse_kernel_for(q)
    split = (cudnn_usable(q) if split is None else split) and dropout_p == 0.0 and kernel.usable(q)
    outputs = []
    for seq in plan.sequences:
        if split and batched and len(seq.query_chunks) == 2:
            (_, first_end), (_, end) = seq.query_chunks
            keys = slice(seq.keys.start, seq.keys.start + end)
            outputs.append(chunk_pair_attention(_rows(q, seq.local), _rows(k, keys), _rows(v, keys), first_end,
                                                scale=scale, kernel=kernel))
            continue
        keys, values = k[seq.keys], v[seq.keys]
        for queries, prefix in seq.query_chunks:
            if split and prefix > queries.stop - queries.start:
                outputs.append(prefix_attention(q[queries], keys[:prefix], values[:prefix], scale=scale,
                                                kernel=kernel))
                continue
            outputs.append(causal_chunk_attention(q[queries], keys[:prefix], values[:prefix],
                                                  scale=scale, dropout_p=dropout_p))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def attend_split(q, k, v, plan: AttentionPlan, *, scale: float, dropout_p: float) -> torch.Tensor:
    """The "split" kernel: attend_causal with the CP chunks as lse-merged kernel calls wherever they serve."""
    return attend_causal(q, k, v, plan, scale=scale, dropout_p=dropout_p, split=True)


def attend_flash_varlen(q, k, v, plan: AttentionPlan, *, scale: float, dropout_p: float) -> torch.Tensor:
    """attend_causal with flash-attn's varlen kernel: one call for every sequence / chunk."""
    # Local queries already are the concatenation of the chunks; causal=True is aligned
    # bottom-right in flash-attn >= 2.1, i.e. lower-right against each chunk's key prefix.
    if plan.varlen_key_index is not None:
        k, v = k.index_select(0, plan.varlen_key_index), v.index_select(0, plan.varlen_key_index)
    return flash_attn_varlen_func(q, k, v, plan.varlen_cu_q, plan.varlen_cu_k, plan.max_query_chunk,
                                  plan.max_key_prefix, dropout_p=dropout_p, softmax_scale=scale, causal=True)


def attend_masked(q, k, v, plan: AttentionPlan, *, scale: float, dropout_p: float) -> torch.Tensor:
    """The "masked" kernel (same inputs and output as attend_causal)."""
    k, v = _in_global_order(k, v, plan)
    outputs = []
    for seq, query_pos in zip(plan.sequences, plan.query_positions):
        keys, values = k[seq.keys], v[seq.keys]
        key_pos = torch.arange(keys.shape[0], device=keys.device)
        outputs.append(masked_attention(q[seq.local], keys, values, query_pos, key_pos,
                                        scale=scale, dropout_p=dropout_p))
    return torch.cat(outputs)


_KERNEL_FUNCTIONS = {"causal": attend_causal, "split": attend_split, "masked": attend_masked}


def window_chunk_attention(q, k, v, offset: int, window: int, *, scale: float, dropout_p: float) -> torch.Tensor:
    """q [tq, hq, d] against k/v [tk, hkv, d], query i sitting `offset` keys after key 0: it sees keys j with
    offset + i - window < j <= offset + i (a band mask). GQA without repeating k/v. -> [tq, hq, d]."""
    query_pos = torch.arange(q.shape[0], device=q.device) + offset
    key_pos = torch.arange(k.shape[0], device=q.device)
    gap = query_pos.unsqueeze(1) - key_pos.unsqueeze(0)
    allowed = (gap >= 0) & (gap < window)
    out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), attn_mask=allowed,
                                         dropout_p=dropout_p, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def attend_windowed(q, k, v, plan: AttentionPlan, *, window: int, scale: float, dropout_p: float) -> torch.Tensor:
    """Sliding-window causal attention (same inputs and output as attend_causal): the query at global position i
    of its sequence sees that sequence's keys i - window < j <= i. Each chunk attends to the bounded key range its
    queries can reach, through a band mask; with flash-attn and fp16/bf16 CUDA inputs, one varlen call whose
    window_size bounds the keys (bottom-right aligned, as the chunks' key prefixes are)."""
    if flash_attn_varlen_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        if plan.varlen_key_index is not None:
            k, v = k.index_select(0, plan.varlen_key_index), v.index_select(0, plan.varlen_key_index)
        return flash_attn_varlen_func(q, k, v, plan.varlen_cu_q, plan.varlen_cu_k, plan.max_query_chunk,
                                      plan.max_key_prefix, dropout_p=dropout_p, softmax_scale=scale, causal=True,
                                      window_size=(window - 1, 0))
    k, v = _in_global_order(k, v, plan)
    outputs = []
    for seq in plan.sequences:
        keys, values = k[seq.keys], v[seq.keys]
        for queries, prefix in seq.query_chunks:
            first = prefix - (queries.stop - queries.start)  # the chunk's first query's position in its sequence
            start = max(0, first - window + 1)
            outputs.append(window_chunk_attention(q[queries], keys[start:prefix], values[start:prefix], first - start,
                                                  window, scale=scale, dropout_p=dropout_p))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


# ------------------------------------------------------------------------------ module
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


def all_gather_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's tokens [t, ...] gathered rank-major over the CP `group` [cp * t, ...], differentiable (the
    backward reduce-scatters the grads): the one CP collective of the layers that need whole sequences."""
    return _AllGatherSequence.apply(tensor, group)


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
        window: Optional[int] = None,
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
        self.kernel = "causal"
        """One of KERNELS; the benchmark and the parity tests switch it per instance."""
        if window is not None and window < 1:
            raise ValueError(f"a sliding window of {window} keys: it must be at least 1")
        self.window = window
        """A sliding layer's key window (its spec's `window` param, local_spec.with_attention_window); None: every
        earlier key of the sequence (the kernels above)."""

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
        if packed:  # [t, heads, d]
            lengths = padded_lengths_of(packed_seq_params)
            out = self._attend_packed(query, key, value, lengths, group, cp_size, cp_rank)
            return out.reshape(out.shape[0], -1)
        # [s, b, heads, d]: every batch element is one sequence of length s*cp.
        s, b = query.shape[:2]
        fold = lambda x: x.transpose(0, 1).reshape(b * s, *x.shape[2:])  # noqa: E731
        out = self._attend_packed(fold(query), fold(key), fold(value),
                                  (s * cp_size,) * b, group, cp_size, cp_rank)
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _attend_packed(self, q, k, v, lengths, group, cp_size, cp_rank) -> torch.Tensor:
        if group is not None:
            # One collective for K and V together; identical on every CP rank of the group.
            kv = all_gather_sequence(torch.cat([k, v], dim=-1), group)
            k, v = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        plan = attention_plan(tuple(lengths), cp_size, cp_rank, q.device)
        dropout_p = self.attention_dropout if self.training else 0.0
        with self._dropout_rng():
            if self.window is not None:
                return attend_windowed(q, k, v, plan, window=self.window, scale=self.softmax_scale,
                                       dropout_p=dropout_p)
            return _KERNEL_FUNCTIONS[self.kernel](q, k, v, plan, scale=self.softmax_scale, dropout_p=dropout_p)

    def _dropout_rng(self):
        # Heads are split over TP, so attention dropout draws from the TP-rank RNG stream
        # (as megatron's DotProductAttention does) unless SP already decorrelates ranks.
        if self.attention_dropout > 0 and self.training and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()
