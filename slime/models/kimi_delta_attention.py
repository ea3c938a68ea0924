"""Kimi delta attention (KDA, Kimi-Linear's linear attention) as a megatron module in a layer's self-attention slot:
TP over heads, SP, packed (THD) batches and context parallelism, as the gated DeltaNet (gated_deltanet.py).

Maths (transformers' KimiLinearDeltaAttention): per token, q, k, v = q_proj x, k_proj x, v_proj x (H heads of D);
q|k|v go through a depthwise causal conv (silu); q, k are L2-normalised; beta = sigmoid(b_proj x) per head; the gate
is per key channel, g = -exp(A_log_h) * softplus(f_b(f_a x) + dt_bias) (f_a: hidden -> D, f_b: D -> H D); the Kimi
delta rule (kda_rule.py) gives o; o is RMS-normalised per head (fp32), scaled by o_norm's weight and gated by
sigmoid(g_b(g_a x)); o_proj returns to the hidden size.

megatron layout (kimi_linear.py maps the HF tensors): `in_proj_weight` rows per head h [q_h | k_h | v_h | b_h],
`conv1d_weight` per head [q_h | k_h | v_h], `gate_up_weight` per head [f_b rows of h | g_b rows of h], `dt_bias` and
`A_log` by head: all split over TP by whole heads. `gate_down_weight` [f_a; g_a] and `norm_weight` are replicated:
every rank feeds its own heads from them, so their gradients are summed over TP (one all-reduce each, in backward).
The layer's input is gathered over the sequence once (SP) and every projection is a local matmul; `linear_proj`
(o_proj) is megatron's row-parallel linear (its reduce-scatter under SP).

Context parallelism as the gated DeltaNet's: each CP rank all-gathers its tokens' conv inputs, gate and beta inputs
(one all-gather over the CP group per layer and micro-batch, backward a reduce-scatter), runs the conv and the rule on
whole sequences and keeps its own zig-zag chunks.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from slime.models import gated_delta_rule, kda_rule
from slime.models.gated_deltanet import full_lengths, over_whole_sequences

# parameters split over TP by heads (dim 0); the others are replicated
_SPLIT = ("in_proj_weight", "conv1d_weight", "gate_up_weight", "dt_bias", "A_log")


def gated_output_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' KimiLinearRMSNormGated: normalise, scale and gate by sigmoid(gate), all in fp32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h * gate.float().sigmoid()).to(x.dtype)


class KimiDeltaAttention(MegatronModule):
    """KDA in a layer's self-attention slot: forward(hidden [s, b, h], ...) -> (output, None)."""

    def __init__(self, config: TransformerConfig, layer_number: int, pg_collection: Any = None, **unused):
        super().__init__(config=config)
        heads, dim, tp = config.linear_num_key_heads, config.linear_key_head_dim, config.tensor_model_parallel_size
        if heads % tp:
            raise ValueError(f"Kimi delta attention: --tensor-model-parallel-size {tp} does not divide its {heads} "
                             "heads (linear_num_heads)")
        self.layer_number, self.heads, self.dim = layer_number, heads // tp, dim
        self.tp_group = getattr(pg_collection, "tp", None) or parallel_state.get_tensor_model_parallel_group()
        self.cp_group = ((getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group())
                         if config.context_parallel_size > 1 else None)
        dtype, hidden, kernel = config.params_dtype, config.hidden_size, config.linear_conv_kernel_dim
        parameter = lambda *shape: torch.nn.Parameter(torch.empty(*shape, dtype=dtype))  # noqa: E731
        self.in_proj_weight = parameter(self.heads * (3 * dim + 1), hidden)
        self.conv1d_weight = parameter(self.heads * 3 * dim, 1, kernel)
        self.gate_down_weight = parameter(2 * dim, hidden)
        self.gate_up_weight = parameter(self.heads * 2 * dim, dim)
        self.dt_bias = torch.nn.Parameter(torch.zeros(self.heads * dim, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.zeros(self.heads, dtype=dtype))
        self.norm_weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype))
        with torch.no_grad():  # every weight is loaded from the checkpoint; a plain init otherwise
            for weight in (self.in_proj_weight, self.conv1d_weight, self.gate_down_weight, self.gate_up_weight):
                config.init_method(weight)
        for name in _SPLIT:
            tensor_parallel.set_tensor_model_parallel_attributes(getattr(self, name), True, 0, 1)
        self.linear_proj = tensor_parallel.RowParallelLinear(
            heads * dim, hidden, config=config, init_method=config.output_layer_init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None, **unused) -> tuple[torch.Tensor, None]:
        x = self._whole_sequence(hidden_states)  # [s, b, h]
        s, b = x.shape[:2]
        tokens = x.transpose(0, 1).reshape(b * s, -1)
        heads, dim = self.heads, self.dim
        projected = F.linear(tokens, self.in_proj_weight).view(b * s, heads, 3 * dim + 1)
        qkv, beta_logit = projected.split([3 * dim, 1], dim=-1)
        f_low, g_low = F.linear(tokens, self._replicated(self.gate_down_weight)).split([dim, dim], dim=-1)
        up = self.gate_up_weight.view(heads, 2, dim, dim)
        forget = torch.einsum("tr,hcr->thc", f_low, up[:, 0])
        gate = torch.einsum("tr,hcr->thc", g_low, up[:, 1])
        local = torch.cat([qkv.flatten(1), forget.flatten(1), beta_logit.flatten(1)], dim=-1)
        cp = self.config.context_parallel_size  # conv + Kimi delta rule
        core = over_whole_sequences(self._recurrence, local, full_lengths(packed_seq_params, s, b, cp), cp,
                                    self.cp_group)
        out = gated_output_norm(core, gate, self._replicated(self.norm_weight), self.config.layernorm_epsilon)
        output, _ = self.linear_proj(out.reshape(b, s, heads * dim).transpose(0, 1))
        return output, None

    def _whole_sequence(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The layer's input for this rank's heads: gathered over the sequence under SP (backward: the heads'
        partial gradients reduce-scattered), else copied into the TP region (backward: all-reduced)."""
        if self.config.tensor_model_parallel_size == 1:
            return hidden_states
        if self.config.sequence_parallel:
            return tensor_parallel.gather_from_sequence_parallel_region(hidden_states, group=self.tp_group)
        return tensor_parallel.copy_to_tensor_model_parallel_region(hidden_states, group=self.tp_group)

    def _replicated(self, weight: torch.Tensor) -> torch.Tensor:
        # every TP rank feeds its own heads from it: its gradient is summed over TP
        if self.config.tensor_model_parallel_size == 1:
            return weight
        return tensor_parallel.copy_to_tensor_model_parallel_region(weight, group=self.tp_group)

    def _recurrence(self, tokens: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        """Whole sequences [T, channels] (concatenated, `lengths` each) -> the rule's output [T, heads, dim]."""
        heads, dim, t = self.heads, self.dim, tokens.shape[0]
        qkv, forget, beta_logit = tokens.split([heads * 3 * dim, heads * dim, heads], dim=-1)
        cu_seqlens = torch.tensor([0, *lengths], device=tokens.device).cumsum(0)
        qkv = gated_delta_rule.causal_conv1d(qkv.unsqueeze(0), self.conv1d_weight.squeeze(1), activation="silu",
                                             cu_seqlens=cu_seqlens)[0]
        q, k, v = qkv.view(t, heads, 3, dim).unbind(2)
        q, k = (gated_delta_rule.l2norm(x.float()) for x in (q, k))
        decay = self.A_log.float().exp().view(heads, 1)
        g = -decay * F.softplus(forget.float() + self.dt_bias.float()).view(t, heads, dim)
        out, _ = kda_rule.chunk_kda_rule(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0),
                                         beta_logit.float().sigmoid().view(1, t, heads), scale=dim ** -0.5,
                                         cu_seqlens=cu_seqlens)
        return out[0]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The head-split parameters split over TP (megatron's default would take them as replicated)."""
        own = {name: param for name, param in self.named_parameters(recurse=False)}
        state = make_sharded_tensors_for_checkpoint(own, prefix, {name: 0 for name in _SPLIT}, sharded_offsets)
        state.update(self.linear_proj.sharded_state_dict(f"{prefix}linear_proj.", sharded_offsets, metadata))
        return state
