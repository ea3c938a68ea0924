"""The gated DeltaNet token mixer (linear attention of Qwen3-Next / Qwen3.5) as a megatron module that takes the
place of a layer's self-attention: TP over key-head groups, SP through megatron's parallel linears, packed (THD)
batches and context parallelism.

Maths (transformers' Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet): per token, an in-projection gives q, k
(`nk` key heads of `dk`), v, z (`nv` value heads of `dv`), b and a (one per value head); q|k|v go through a
depthwise causal conv (silu); q, k are L2-normalised (value head h reads key head h // (nv / nk): the rule
groups the value heads, fla's kernels without repeating q and k); beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule
(slime/models/gated_delta_rule.py) gives o; o is RMS-normalised per head (a plain weight, not zero-centred) and
gated by silu(z); an out-projection returns to the hidden size.

megatron layout (what hf_weights.py maps the HF tensors to, see qwen3_5.py): rows of `in_proj` grouped per key
head j: [q_j | k_j | v_j (r heads) | z_j (r heads) | b_j (r) | a_j (r)] with r = nv / nk, so a TP shard of whole
key-head groups is contiguous; `conv1d_weight` [C, 1, K] per group [q_j | k_j | v_j]; A_log and dt_bias split by
value heads; the norm weight [dv] is shared by all heads (its gradient summed over TP).

Context parallelism: the recurrence runs over a whole sequence, so each CP rank all-gathers its tokens' conv
inputs and b/a (one all-gather over the CP group per layer and micro-batch, the helper cp_attention.py uses for
K/V, whose backward is a reduce-scatter), puts them in each sequence's global order, runs the conv and the
recurrence on whole sequences and keeps its own zig-zag chunks. Cost: CP x the layer's recurrence work per rank
and an all-gather of (2 nk dk + nv dv + 2 nv) / TP values per token.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from slime.models import gated_delta_rule
from slime.models.cp_attention import all_gather_sequence, attention_plan, padded_lengths_of


def _group_of(pg_collection: Any, name: str, default) -> Any:
    group = getattr(pg_collection, name, None) if pg_collection is not None else None
    return group if group is not None else default()


@functools.lru_cache(maxsize=64)
def _local_index(lengths: tuple[int, ...], cp_size: int, cp_rank: int, device: torch.device) -> torch.Tensor:
    """Index, in the global-order token buffer, of every token this CP rank holds (in its local order)."""
    plan = attention_plan(lengths, cp_size, cp_rank, device)
    inverse = torch.empty_like(plan.key_order)
    inverse[plan.key_order] = torch.arange(plan.key_order.numel(), device=plan.key_order.device)
    local_total = plan.key_order.numel() // cp_size
    return inverse[cp_rank * local_total:(cp_rank + 1) * local_total]


def full_lengths(params: Optional[PackedSeqParams], s: int, b: int, cp_size: int) -> tuple[int, ...]:
    """Full (all CP ranks) padded length of each sequence of the local tokens [s, b]."""
    if params is not None and params.qkv_format == "thd":
        return tuple(padded_lengths_of(params))
    return (s * cp_size,) * b


def over_whole_sequences(recurrence: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor], local: torch.Tensor,
                         lengths: tuple[int, ...], cp_size: int, cp_group: Any) -> torch.Tensor:
    """`recurrence` (whole sequences [T, channels] concatenated in global order, `lengths` each -> [T, ...]) of this
    CP rank's tokens [t, channels]: a recurrence needs every earlier token, so the CP ranks' tokens are gathered,
    the whole sequences run, and this rank's rows kept."""
    if cp_size > 1:
        rank = torch.distributed.get_rank(cp_group)
        plan = attention_plan(lengths, cp_size, rank, local.device)
        whole = all_gather_sequence(local, cp_group)[plan.key_order]  # each sequence in global order
        return recurrence(whole, lengths)[_local_index(lengths, cp_size, rank, local.device)]
    return recurrence(local, lengths)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNormGated: normalise in fp32, scale by weight in x's dtype, times silu(gate) in fp32."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet in a layer's self-attention slot: forward(hidden [s, b, h], ...) -> (output, None)."""

    def __init__(self, config: TransformerConfig, layer_number: int, pg_collection: Any = None, **unused):
        super().__init__(config=config)
        key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        tp = config.tensor_model_parallel_size
        if key_heads % tp or value_heads % key_heads:
            raise ValueError(f"gated DeltaNet: {key_heads} key heads / {value_heads} value heads cannot be split "
                             f"over TP {tp}")
        self.layer_number = layer_number
        self.groups = key_heads // tp
        self.ratio = value_heads // key_heads
        self.value_heads = self.groups * self.ratio
        self.tp_group = _group_of(pg_collection, "tp", parallel_state.get_tensor_model_parallel_group)
        self.cp_group = _group_of(pg_collection, "cp", parallel_state.get_context_parallel_group) \
            if config.context_parallel_size > 1 else None
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        dk, dv, r = self.key_dim, self.value_dim, self.ratio
        self.group_width = 2 * dk + 2 * r * dv + 2 * r
        self.conv_width = 2 * dk + r * dv
        self.in_proj = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, key_heads * self.group_width, config=config,
            init_method=config.init_method, bias=False, gather_output=False, skip_bias_add=True)
        dtype, kernel = config.params_dtype, config.linear_conv_kernel_dim
        self.conv1d_weight = torch.nn.Parameter(torch.empty(self.groups * self.conv_width, 1, kernel, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(self.value_heads, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.value_heads, dtype=dtype))
        for param in (self.conv1d_weight, self.A_log, self.dt_bias):
            tensor_parallel.set_tensor_model_parallel_attributes(param, True, 0, 1)
        with torch.no_grad():
            config.init_method(self.conv1d_weight)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16.0).log())
        self.norm_weight = torch.nn.Parameter(torch.ones(dv, dtype=dtype))
        self.out_proj = tensor_parallel.RowParallelLinear(
            value_heads * dv, config.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None, **unused) -> tuple[torch.Tensor, None]:
        projected, _ = self.in_proj(hidden_states)  # [s, b, groups * group_width]
        s, b = projected.shape[:2]
        tokens = projected.transpose(0, 1).reshape(b * s, self.groups, self.group_width)
        dv, r = self.value_dim, self.ratio
        mixed, z, beta_logit, a = tokens.split([self.conv_width, r * dv, r, r], dim=-1)
        cp = self.config.context_parallel_size
        local = torch.cat([mixed.flatten(1), beta_logit.flatten(1), a.flatten(1)], dim=-1)  # conv + gated delta rule
        core = over_whole_sequences(self._recurrence, local, full_lengths(packed_seq_params, s, b, cp), cp,
                                    self.cp_group)
        out = gated_rms_norm(core, z.reshape(b * s, self.value_heads, dv), self._norm_weight(),
                             self.config.layernorm_epsilon)
        out = out.reshape(b, s, self.value_heads * dv).transpose(0, 1)
        output, _ = self.out_proj(out)
        return output, None

    def _norm_weight(self) -> torch.Tensor:
        # every TP rank normalises its own heads with the shared weight: its gradient is summed over TP
        # (one all-reduce of dv values over the TP group in backward)
        if self.config.tensor_model_parallel_size == 1:
            return self.norm_weight
        return tensor_parallel.copy_to_tensor_model_parallel_region(self.norm_weight, group=self.tp_group)

    def _recurrence(self, tokens: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        """Whole sequences [T, channels] (concatenated, `lengths` each) -> the rule's output [T, heads, dv]."""
        dk, dv, r, groups = self.key_dim, self.value_dim, self.ratio, self.groups
        t = tokens.shape[0]
        mixed, beta_logit, a = tokens.split([groups * self.conv_width, groups * r, groups * r], dim=-1)
        cu_seqlens = torch.tensor([0, *lengths], device=tokens.device).cumsum(0)
        weight = self.conv1d_weight.squeeze(1)
        mixed = gated_delta_rule.causal_conv1d(mixed.unsqueeze(0), weight, activation="silu",
                                               cu_seqlens=cu_seqlens)[0]
        q, k, v = mixed.reshape(t, groups, self.conv_width).split([dk, dk, r * dv], dim=-1)
        q, k = (gated_delta_rule.l2norm(x) for x in (q, k))  # value head j reads key head j // r
        v = v.reshape(t, groups * r, dv)
        beta = beta_logit.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out, _ = gated_delta_rule.chunk_gated_delta_rule(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
            scale=dk ** -0.5, cu_seqlens=cu_seqlens)
        return out[0]
