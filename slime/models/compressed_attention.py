"""DeepSeek-V4's attention (sliding, compressed sparse and heavily compressed) on megatron-core, in pure torch.

Per layer (transformers' DeepseekV4Attention is the reference; d = head_dim, r = q_lora_rank):

    q_lat = RMSNorm(x W_qa)                 [r]      kv = RoPE(RMSNorm(x W_kv))   [d]  (one head: K = V)
    q_h   = RoPE(unit_RMS(q_lat W_qb)_h)    [H, d]   RoPE on the last rope_dim dimensions, interleaved pairs
    out_h = softmax([q_h k / sqrt(d) over the keys a query sees; sink_h]) without the sink's column, times K = V
    o     = W_ob (W_oa,g (RoPE^-1(out) grouped into o_groups))

The keys a query at position p sees: the window p - sliding_window < j <= p of its sequence, and in a compressed
layer the compressed keys of the windows that end at or before it (entry w covers tokens [w m, (w + 1) m)):

- heavily compressed (`compress_rates["heavily_compressed_attention"]` = m'): entry w is the softmax-gated sum
  (per channel, gate + a learned position bias) of its m' tokens' projections, RMS-normed and rotated at w m';
  every entry with w < (p + 1) // m' is visible;
- compressed sparse (m): entry w pools 2m slots, the previous window's first-half projections and its own
  window's second half; the lightning indexer (its own compressor at index_head_dim, queries from q_lat, weighted
  ReLU scores over index_n_heads) keeps the `index_topk` best visible entries per query. The choice is not
  differentiable and transformers' indexer gets no gradient: its parameters are frozen.

Parallelism. A "replicated" region (everything from x to q_lat, the shared key, the compressors and the indexer;
the weights whole on every TP rank) feeds a "head" region split over TP (W_qb's rows, the sinks, whole output
groups of W_oa, W_ob's columns: o_groups % TP == 0). Where the head region reads the replicated one, megatron's
copy-to-TP mapping all-reduces the gradient, so every TP rank gets the whole gradient of the replicated weights
and of x (under SP x is gathered with a backward that keeps this rank's rows, not a sum). The output is summed
over TP (reduce-scattered over the sequence under SP). Context parallelism splits the queries only: the layer input
is all-gathered over CP (backward: reduce-scatter) and put in each sequence's order, and each CP rank builds every
key, compressed key and indexer key of its sequences from it, so a compression window never has to be split
between ranks.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule

from slime.models.cp_attention import AttentionPlan, all_gather_sequence, attention_plan, padded_lengths_of
from slime.models.deepseek_v4 import CSA, HCA, SLIDING, DeepseekV4Layers, Rotary


# ------------------------------------------------------------------ RoPE and norms (transformers' maths)
def inverse_frequencies(rotary: Rotary) -> torch.Tensor:
    """transformers' default or YaRN inverse frequencies (float32, one per rotated pair)."""
    dim = rotary.dim
    pos_freqs = rotary.base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolated = 1.0 / pos_freqs
    if rotary.yarn_factor is None:
        return extrapolated

    def correction(rotations: float) -> float:
        return dim * math.log(rotary.original_max_position_embeddings / (rotations * 2 * math.pi)) / \
            (2 * math.log(rotary.base))

    low = max(math.floor(correction(rotary.beta_fast)), 0)
    high = min(math.ceil(correction(rotary.beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return 1.0 / (rotary.yarn_factor * pos_freqs) * (1 - extrapolation) + extrapolated * extrapolation


class RotaryTable:
    """A rotary embedding's inverse frequencies per device (kept out of the module's buffers: a bf16 model's
    buffers are cast to bf16)."""

    def __init__(self, rotary: Rotary) -> None:
        self.rotary = rotary
        self._inv_freq = inverse_frequencies(rotary)
        self._on: dict[torch.device, torch.Tensor] = {}

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [t, ..., d] with its last `dim` dimensions rotated in interleaved pairs at `positions` [t];
        `inverse`: the conjugate rotation (transformers' -sin on the attention output)."""
        inv_freq = self._on.get(x.device)
        if inv_freq is None:
            inv_freq = self._on.setdefault(x.device, self._inv_freq.to(x.device))
        angles = positions.float()[:, None] * inv_freq[None]
        shape = (angles.shape[0],) + (1,) * (x.dim() - 2) + (angles.shape[1],)
        scale = self.rotary.attention_factor
        cos = (angles.cos() * scale).to(x.dtype).float().view(shape)
        sin = (angles.sin() * scale).to(x.dtype).float().view(shape)
        sin = -sin if inverse else sin
        rotated = x[..., -self.rotary.dim:]
        even, odd = rotated[..., 0::2].float(), rotated[..., 1::2].float()
        pairs = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2).to(x.dtype)
        return torch.cat([x[..., :-self.rotary.dim], pairs], dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4RMSNorm: normalised and scaled in fp32, cast back."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4UnweightedRMSNorm (each query head)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


# ------------------------------------------------------------------ parameters
def _device(config) -> torch.device:
    return torch.device("cpu") if config.use_cpu_initialization or not torch.cuda.is_available() \
        else torch.device("cuda", torch.cuda.current_device())


def _weight(config, full_shape: tuple[int, ...], split_dim: int | None = None, init=None,
            fp32: bool = False) -> torch.nn.Parameter:
    """A weight initialised whole (the default generator: the same on every TP rank), then this TP rank's
    contiguous part along `split_dim` (None: replicated); `fp32`: kept in fp32 whatever --bf16 says, as
    transformers keeps V4's sinks, position biases and norms (DeepseekV4Layers.fp32_weights)."""
    full = torch.empty(full_shape, dtype=torch.float32)
    (init or config.init_method)(full)
    if split_dim is not None:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        full = full.chunk(tp, dim=split_dim)[parallel_state.get_tensor_model_parallel_rank()]
    dtype = torch.float32 if fp32 and config.hf_layer_config.fp32_weights else config.params_dtype
    param = torch.nn.Parameter(full.to(device=_device(config), dtype=dtype).contiguous())
    if split_dim is not None:
        set_tensor_model_parallel_attributes(param, True, split_dim, 1)
    return param


class _Linear(torch.nn.Module):
    """A bias-free projection holding `weight` [out, in] (whole, or this TP rank's part)."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _NormWeight(torch.nn.Module):
    def __init__(self, config, size: int) -> None:
        super().__init__()
        self.weight = _weight(config, (size,), init=torch.nn.init.ones_, fp32=True)


# ------------------------------------------------------------------ compressor and indexer
class Compressor(torch.nn.Module):
    """One compressed key per `ratio` tokens (HF `compressor.{wkv, wgate, ape, norm}`); `overlap`: each key pools
    the previous window's first-half projections with its own window's second half (2 x ratio slots)."""

    def __init__(self, config, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = dim * (2 if overlap else 1)
        self.dim, self.ratio, self.overlap, self.eps = dim, ratio, overlap, eps
        self.linear_kv_proj = _Linear(_weight(config, (width, config.hidden_size)))
        self.linear_gate_proj = _Linear(_weight(config, (width, config.hidden_size)))
        self.position_bias = _weight(config, (ratio, width), init=torch.nn.init.zeros_, fp32=True)
        self.norm = _NormWeight(config, dim)

    def forward(self, x: torch.Tensor, rope: RotaryTable) -> torch.Tensor:
        """x [L, hidden] (one sequence, in order) -> [L // ratio, dim] (rotated at the windows' first positions)."""
        m, windows = self.ratio, x.shape[0] // self.ratio
        if windows == 0:
            return x.new_zeros(0, self.dim)
        used = x[: windows * m]
        kv = self.linear_kv_proj(used).view(windows, m, -1)
        gate = self.linear_gate_proj(used).view(windows, m, -1) + self.position_bias.float()
        if self.overlap:
            d = self.dim
            first_kv = torch.cat([kv.new_zeros(1, m, d), kv[:-1, :, :d]])
            first_gate = torch.cat([gate.new_full((1, m, d), float("-inf")), gate[:-1, :, :d]])
            kv = torch.cat([first_kv, kv[..., d:]], dim=1)
            gate = torch.cat([first_gate, gate[..., d:]], dim=1)
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        pooled = rms_norm(pooled, self.norm.weight, self.eps)
        return rope.rotate(pooled, torch.arange(windows, device=x.device) * m)


class LightningIndexer(torch.nn.Module):
    """V4's indexer (HF `indexer.{compressor.*, wq_b, weights_proj}`), replicated over TP and frozen."""

    def __init__(self, config, layers: DeepseekV4Layers) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = layers.index_heads, layers.index_head_dim, layers.index_topk
        self.ratio = layers.ratio(CSA)
        self.compressor = Compressor(config, self.dim, self.ratio, overlap=True, eps=layers.norm_eps)
        self.linear_q_up_proj = _Linear(_weight(config, (self.heads * self.dim, layers.q_lora_rank)))
        self.weights_proj = _Linear(_weight(config, (self.heads, config.hidden_size)))
        for param in self.parameters():
            param.requires_grad_(False)

    @torch.no_grad()
    def select(self, x_seq, x_q, q_lat, positions, rope: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
        """([tq, k] compressed-key indices, [tq, k] which of them are causal): each query's `index_topk` best
        (k = min(index_topk, L // ratio)), scored a chunk of queries at a time."""
        keys = self.compressor(x_seq, rope).float()
        q = rope.rotate(self.linear_q_up_proj(q_lat).view(-1, self.heads, self.dim), positions).float()
        weights = self.weights_proj(x_q).float() * self.heads ** -0.5
        k = min(self.topk, keys.shape[0])
        index, valid = [], []
        for rows in _chunks(q.shape[0]):
            scores = F.relu(torch.einsum("thd,cd->thc", q[rows], keys)) * self.dim ** -0.5
            total = (scores * weights[rows, :, None]).sum(dim=1)
            ready = ((positions[rows] + 1) // self.ratio)[:, None]
            future = torch.arange(keys.shape[0], device=keys.device)[None] >= ready
            top = total.masked_fill(future, float("-inf")).topk(k, dim=-1).indices
            index.append(top)
            valid.append(top < ready)
        return torch.cat(index), torch.cat(valid)


QUERY_CHUNK = 2048
"""Queries per attention (and indexer) call: bounds the gathered keys and the logits a call holds."""


def _chunks(count: int) -> list[slice]:
    return [slice(start, min(start + QUERY_CHUNK, count)) for start in range(0, count, QUERY_CHUNK)]


def sink_attention(q, keys, positions, compressed, index, valid, sinks, window: int, scale: float) -> torch.Tensor:
    """q [tq, H, d] of one sequence against its keys [L, d] (K = V) in the window before each query and the
    compressed keys [Lc, d] at `index` [tq, k] where `valid`, with a sink logit per head -> [tq, H, d]."""
    width = min(window, keys.shape[0])
    local_index = positions[:, None] - torch.arange(width - 1, -1, -1, device=q.device)[None]  # p - width + 1 .. p
    gathered = [keys[local_index.clamp(min=0)]]  # [tq, width, d]
    masks = [local_index >= 0]
    if compressed is not None and index.shape[-1]:
        gathered.append(compressed[index])
        masks.append(valid)
    seen = torch.cat(gathered, dim=1)  # [tq, width + k, d]
    logits = torch.einsum("thd,tnd->thn", q, seen).float().mul(scale).masked_fill(~torch.cat(masks, 1)[:, None],
                                                                                  float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    return torch.einsum("thn,tnd->thd", probs, seen)


# ------------------------------------------------------------------ the attention
class CompressedSparseAttention(MegatronModule):
    """A V4 attention of one kind (SLIDING, CSA, HCA); forward(hidden_states [s, b, h], packed_seq_params) ->
    [s, b, h], sharded over the sequence like its input under SP."""

    def __init__(self, config, layer_number: int, kind: str, pg_collection=None, **unused) -> None:
        super().__init__(config=config)
        layers: DeepseekV4Layers = config.hf_layer_config
        tp = config.tensor_model_parallel_size
        heads, d, groups = config.num_attention_heads, layers.head_dim, layers.o_groups
        if heads % tp or groups % tp:
            raise ValueError(f"DeepSeek-V4: --tensor-model-parallel-size {tp} must divide the {heads} heads and the "
                             f"{groups} output groups (o_groups); pick a TP size dividing {math.gcd(heads, groups)}")
        self.kind, self.layer_number, self.layers = kind, layer_number, layers
        self.local_heads, self.local_groups, self.head_dim = heads // tp, groups // tp, d
        self.window, self.eps, self.scale = layers.sliding_window, layers.norm_eps, d ** -0.5
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.rope = RotaryTable(layers.main_rope if kind == SLIDING else layers.compress_rope)
        hidden, rank = config.hidden_size, layers.q_lora_rank
        # replicated
        self.linear_q_down_proj = _Linear(_weight(config, (rank, hidden)))
        self.q_layernorm = _NormWeight(config, rank)
        self.linear_kv_proj = _Linear(_weight(config, (d, hidden)))
        self.kv_layernorm = _NormWeight(config, d)
        # split over TP by heads / output groups
        self.linear_q_up_proj = _Linear(_weight(config, (heads * d, rank), split_dim=0))
        self.sinks = _weight(config, (heads,), split_dim=0, init=torch.nn.init.zeros_, fp32=True)
        self.linear_o_group_proj = _Linear(_weight(config, (groups * layers.o_lora_rank, heads * d // groups),
                                                   split_dim=0))
        self.linear_proj = _Linear(_weight(config, (hidden, groups * layers.o_lora_rank), split_dim=1,
                                           init=config.output_layer_init_method))
        self.compressor = None if kind == SLIDING else Compressor(config, d, layers.ratio(kind), overlap=kind == CSA,
                                                                  eps=self.eps)
        self.indexer = LightningIndexer(config, layers) if kind == CSA else None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """--save / --load: the head-split weights with their TP axis (megatron's default takes a module it does not
        know for replicated), the rest replicated."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {name: param.partition_dim for name, param in self.named_parameters()
                if getattr(param, "tensor_model_parallel", False)}
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                   sharded_offsets)

    def _cp(self) -> tuple[Optional[torch.distributed.ProcessGroup], int, int]:
        if self.config.context_parallel_size == 1:
            return None, 1, 0
        group = self.cp_group or parallel_state.get_context_parallel_group()
        return group, torch.distributed.get_world_size(group), torch.distributed.get_rank(group)

    def forward(self, hidden_states: torch.Tensor, packed_seq_params: Optional[PackedSeqParams] = None,
                **unused) -> torch.Tensor:
        sequence_parallel = self.config.sequence_parallel and self.config.tensor_model_parallel_size > 1
        x = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False) \
            if sequence_parallel else hidden_states
        s, b, hidden = x.shape
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        group, cp_size, cp_rank = self._cp()
        tokens = x.reshape(-1, hidden) if packed else x.transpose(0, 1).reshape(b * s, hidden)
        lengths = padded_lengths_of(packed_seq_params) if packed else (s * cp_size,) * b
        plan = attention_plan(tuple(lengths), cp_size, cp_rank, x.device)
        whole = tokens if group is None else \
            all_gather_sequence(tokens, group).index_select(0, plan.key_order)  # each sequence in order
        out = self._attend(tokens, whole, plan)
        out = out.view(s, b, hidden) if packed else out.view(b, s, hidden).transpose(0, 1).contiguous()
        if self.config.tensor_model_parallel_size == 1:
            return out
        return reduce_scatter_to_sequence_parallel_region(out) if sequence_parallel else \
            reduce_from_tensor_model_parallel_region(out)

    def _attend(self, tokens: torch.Tensor, whole: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """This rank's queries [t, h] against the keys of their whole sequences (`whole`, in sequence order) ->
        [t, h], this TP rank's heads' share of the output projection."""
        positions = torch.cat(plan.query_positions)
        key_positions = torch.cat([torch.arange(seq.keys.stop - seq.keys.start, device=whole.device)
                                   for seq in plan.sequences])
        # replicated over TP
        q_lat = rms_norm(self.linear_q_down_proj(tokens), self.q_layernorm.weight, self.eps)
        keys = self.rope.rotate(rms_norm(self.linear_kv_proj(whole), self.kv_layernorm.weight, self.eps),
                                key_positions)
        compressed, selected = self._compressed(tokens, whole, q_lat, plan)
        # split over TP: the gradient of what the heads read is summed over TP
        shared = copy_to_tensor_model_parallel_region(torch.cat([keys, *compressed]))
        keys, *compressed = shared.split([keys.shape[0], *(c.shape[0] for c in compressed)])
        q = self.linear_q_up_proj(copy_to_tensor_model_parallel_region(q_lat))
        q = self.rope.rotate(unit_rms(q.view(-1, self.local_heads, self.head_dim), self.eps), positions)
        outputs = []
        for number, (seq, pos) in enumerate(zip(plan.sequences, plan.query_positions)):
            queries, seq_keys = q[seq.local], keys[seq.keys]
            chosen = compressed[number] if compressed else None
            index, valid = selected[number] if selected else (None, None)
            for rows in _chunks(queries.shape[0]):
                parts = (queries[rows], seq_keys, pos[rows], chosen, None if index is None else index[rows],
                         None if valid is None else valid[rows], self.sinks)
                attend = functools.partial(sink_attention, window=self.window, scale=self.scale)
                # recomputed in the backward: only the chunk's inputs are kept, not its gathered keys and logits
                outputs.append(torch.utils.checkpoint.checkpoint(attend, *parts, use_reentrant=False)
                               if torch.is_grad_enabled() else attend(*parts))
        out = self.rope.rotate(torch.cat(outputs), positions, inverse=True)
        grouped = out.reshape(out.shape[0], self.local_groups, -1)
        weight = self.linear_o_group_proj.weight.view(self.local_groups, -1, grouped.shape[-1])
        projected = torch.einsum("tgi,goi->tgo", grouped, weight).reshape(out.shape[0], -1)
        return self.linear_proj(projected)

    def _compressed(self, tokens, whole, q_lat, plan: AttentionPlan) -> tuple[list, list]:
        """Per sequence: its compressed keys [Lc, d], and which of them each of this rank's queries sees ([tq, k]
        indices, [tq, k] valid): the indexer's choice, or every compressed key (causal ones valid)."""
        if self.compressor is None:
            return [], []
        compressed, selected = [], []
        for seq, pos in zip(plan.sequences, plan.query_positions):
            keys = self.compressor(whole[seq.keys], self.rope)
            compressed.append(keys)
            if self.indexer is not None:
                selected.append(self.indexer.select(whole[seq.keys], tokens[seq.local], q_lat[seq.local], pos,
                                                    self.rope))
                continue
            every = torch.arange(keys.shape[0], device=keys.device).expand(pos.shape[0], -1)
            selected.append((every, every < ((pos + 1) // self.compressor.ratio)[:, None]))
        return compressed, selected
