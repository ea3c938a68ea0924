"""DeepSeek sparse attention (DSA) on this project's CP/THD core attention, in pure torch (GLM-5's layers).

A lightning indexer scores every (query, earlier key) pair of a sequence with its own small projections and
keeps the `index_topk` best keys per query; the attention then runs over the causal keys it kept.

    q_i = wq_b(q_latent)            [H, D]   (q_latent: MLA's normalised q down projection)
    k   = LayerNorm(wk(x))          [D]      (x: the layer's normalised input)
    w   = weights_proj(x) / sqrt(H) [H]
    score(t, s) = sum_h w_h * relu(q_h(t) . k(s) / sqrt(D)),   RoPE (interleaved pairs) on the first
                                                               qk_rope_head_dim dimensions of q and k.

The choice is not differentiable and, as in transformers' GlmMoeDsaForCausalLM (the reference), the indexer
gets no gradient: its parameters are frozen (megatron-core's DSA trains them only through its optional KL
loss, `dsa_indexer_loss_coeff`, which transformers does not have). A sequence shorter than `index_topk`
keeps every causal key (the top-k is clamped at run time, as transformers and megatron-core do).

megatron-core 0.16's `experimental_attention_variant/dsa.py` is not used: it refuses context parallelism,
has no packed (THD) path, applies a Hadamard rotation transformers does not, and lays the rope dimensions
after the others (GLM-5's indexer puts them first). Here the indexer's keys are all-gathered over CP like
the attention's K/V (upstream's `--allgather-cp`), so each query scores every key of its sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from slime.models.cp_attention import AttentionPlan, ContextParallelAttention, all_gather_sequence, attention_plan

logger = logging.getLogger(__name__)


class LightningIndexer(torch.nn.Module):
    """GLM-5's indexer projections (replicated over TP, frozen): HF names wq_b, wk, k_norm, weights_proj."""

    def __init__(self, config) -> None:
        super().__init__()
        heads, dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.heads, self.dim, self.topk = heads, dim, config.dsa_indexer_topk
        self.rope_dim, self.rope_base = config.qk_pos_emb_head_dim, config.rotary_base
        self.wq_b = torch.nn.Linear(config.q_lora_rank, heads * dim, bias=False)
        self.wk = torch.nn.Linear(config.hidden_size, dim, bias=False)
        self.k_norm = torch.nn.LayerNorm(dim, eps=1e-6)
        self.weights_proj = torch.nn.Linear(config.hidden_size, heads, bias=False)
        dtype = config.params_dtype
        for param in self.parameters():
            param.data = param.data.to(dtype)
            param.requires_grad_(False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE on interleaved pairs of the first rope_dim dimensions, the rotated pairs laid out as
        [evens | odds] (transformers' layout; q and k share it, so the dot products are RoPE's)."""
        rot, rest = x.split([self.rope_dim, self.dim - self.rope_dim], dim=-1)
        inv_freq = 1.0 / (self.rope_base ** (torch.arange(0, self.rope_dim, 2, dtype=torch.float,
                                                          device=x.device) / self.rope_dim))
        angles = positions.float()[:, None] * inv_freq
        shape = (angles.shape[0],) + (1,) * (x.dim() - 2) + (angles.shape[1],)
        cos, sin = angles.cos().view(shape).to(x.dtype), angles.sin().view(shape).to(x.dtype)
        even, odd = rot[..., 0::2], rot[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin, rest], dim=-1)

    def queries_and_keys(self, x, q_latent, positions):
        """Local tokens -> (q [t, H, D], head weights [t, H], k [t, D])."""
        q = self._rope(self.wq_b(q_latent).view(-1, self.heads, self.dim), positions)
        k = self._rope(self.k_norm(self.wk(x)), positions)
        weights = self.weights_proj(x).float() * self.heads ** -0.5
        return q, weights, k

    def select(self, q, weights, keys, query_pos) -> torch.Tensor:
        """[tq, L] boolean: the causal keys among the top-k scored ones for each query of one sequence."""
        key_pos = torch.arange(keys.shape[0], device=keys.device)
        causal = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
        scaled_keys = keys.float().t() * self.dim ** -0.5
        scores = torch.zeros(causal.shape, dtype=torch.float, device=keys.device)
        for head in range(self.heads):  # head by head: [tq, L] at a time, not [tq, H, L]
            scores += weights[:, head, None] * F.relu(q[:, head].float() @ scaled_keys)
        scores = scores.masked_fill(~causal, float("-inf"))
        top = scores.topk(min(self.topk, keys.shape[0]), dim=-1).indices
        chosen = torch.zeros_like(causal).scatter_(-1, top, True)
        return causal & chosen


def _tokens_first(t: torch.Tensor) -> torch.Tensor:
    """[s, b, d] -> [b * s, d] (the fold of ContextParallelAttention); a packed [t, d] / [t, 1, d] -> [t, d]."""
    return t if t.dim() == 2 else t.transpose(0, 1).reshape(-1, t.shape[-1])


class SparseContextParallelAttention(ContextParallelAttention):
    """ContextParallelAttention whose causal mask keeps only the indexer's top-k keys per query.

    The layer's normalised input and MLA's q latent arrive through `indexer_inputs`, set by
    SparseLatentSelfAttention right before this module runs (megatron's MLA passes them to its own DSA only
    when experimental_attention_variant is "dsa", which megatron-core refuses under CP)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.indexer = LightningIndexer(config)
        self.indexer_inputs = None

    def _attend_packed(self, q, k, v, lengths, group, cp_size, cp_rank) -> torch.Tensor:
        plan = attention_plan(tuple(lengths), cp_size, cp_rank, q.device)
        with torch.no_grad():
            allowed = self._allowed(plan, group)
        if group is not None:
            kv = all_gather_sequence(torch.cat([k, v], dim=-1), group)
            k, v = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        if plan.key_order is not None:
            k, v = k.index_select(0, plan.key_order), v.index_select(0, plan.key_order)
        dropout_p = self.attention_dropout if self.training else 0.0
        outputs = []
        with self._dropout_rng():
            for seq, mask in zip(plan.sequences, allowed):
                outputs.append(_masked(q[seq.local], k[seq.keys], v[seq.keys], mask, self.softmax_scale, dropout_p))
        return torch.cat(outputs)

    def _allowed(self, plan: AttentionPlan, group) -> list[torch.Tensor]:
        if self.indexer_inputs is None:
            raise RuntimeError("sparse attention ran without the indexer's inputs (SparseLatentSelfAttention sets "
                               "them); build GLM-5 layers with glm_moe_dsa.dsa_layer_spec")
        x, q_latent = self.indexer_inputs
        self.indexer_inputs = None
        if self.config.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
            x, q_latent = gather_from_sequence_parallel_region(x), gather_from_sequence_parallel_region(q_latent)
        positions = torch.cat(plan.query_positions)
        q, weights, k = self.indexer.queries_and_keys(_tokens_first(x), _tokens_first(q_latent), positions)
        if group is not None:  # the indexer's keys of the whole sequence, as the attention's K/V
            gathered = torch.empty((dist.get_world_size(group) * k.shape[0], k.shape[1]), dtype=k.dtype,
                                   device=k.device)
            dist.all_gather_into_tensor(gathered, k.contiguous(), group=group)
            k = gathered.index_select(0, plan.key_order)
        return [self.indexer.select(q[seq.local], weights[seq.local], k[seq.keys], pos)
                for seq, pos in zip(plan.sequences, plan.query_positions)]


def _masked(q, k, v, allowed, scale: float, dropout_p: float) -> torch.Tensor:
    """q [tq, h, d], k/v [tk, h, d] (one kv head per query head: MLA) under a [tq, tk] boolean mask."""
    heads_first = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731
    out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), attn_mask=allowed,
                                         dropout_p=dropout_p, scale=scale)
    return out.squeeze(0).transpose(0, 1)


@functools.cache
def sparse_latent_attention(base: type) -> type:
    """`base` (an MLASelfAttention) handing its normalised input and q latent to the sparse core attention."""

    class SparseLatentSelfAttention(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.checkpoint_core_attention:
                # a recomputed core attention would run without the indexer's inputs (handed over per forward)
                logger.warning("--recompute-granularity selective: GLM-5's sparse core attention is not recomputed "
                               "(its indexer's inputs are not checkpointed); --recompute-granularity full is")
                self.checkpoint_core_attention = False

        def get_query_key_value_tensors(self, hidden_states, *args, **kwargs):
            query, key, value, q_latent, kv_latent = super().get_query_key_value_tensors(hidden_states, *args,
                                                                                       **kwargs)
            self.core_attention.indexer_inputs = (hidden_states, q_latent)
            return query, key, value, q_latent, kv_latent

    return SparseLatentSelfAttention


def with_sparse_attention(spec):
    """A local MLA layer spec (deepseek_v3.mla_layer_spec) with DSA's attention modules."""
    attention = spec.submodules.self_attention
    sub = dataclasses.replace(attention.submodules, core_attention=SparseContextParallelAttention)
    attention = dataclasses.replace(attention, module=sparse_latent_attention(attention.module), submodules=sub)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))
