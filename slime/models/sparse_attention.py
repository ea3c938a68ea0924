"""DeepSeek sparse attention (DSA) on this project's CP/THD core attention, in pure torch (GLM-5's layers).

A lightning indexer scores every (query, earlier key) pair of a sequence with its own small projections and
keeps the `index_topk` best keys per query; the attention then runs over the causal keys it kept.

    q_i = wq_b(q_latent)            [H, D]   (q_latent: MLA's normalised q down projection)
    k   = LayerNorm(wk(x))          [D]      (x: the layer's normalised input)
    w   = weights_proj(x) / sqrt(H) [H]
    score(t, s) = sum_h w_h * relu(q_h(t) . k(s) / sqrt(D)),   RoPE on the first qk_rope_head_dim dimensions
                                                               of q and k: on interleaved pairs (GLM-5) or on
                                                               two halves (DeepSeek-V3.2), with the model's
                                                               frequencies (YaRN's where the MLA has them).

The choice is not differentiable and, as in transformers' GlmMoeDsaForCausalLM (the reference), the indexer
gets no gradient by default: its parameters are frozen. --dsa-indexer-loss-coeff (megatron-core's KL loss, which
transformers does not have; indexer_loss.py) trains them towards the main attention. A sequence shorter than `index_topk`
keeps every causal key (the top-k is clamped at run time, as transformers and megatron-core do).

megatron-core 0.16's `experimental_attention_variant/dsa.py` is not used: it refuses context parallelism,
has no packed (THD) path, applies a Hadamard rotation transformers does not, and lays the rope dimensions
after the others (GLM-5's indexer puts them first). Here the indexer's keys are all-gathered over CP like
the attention's K/V (upstream's `--allgather-cp`), so each query scores every key of its sequence.

GLM-5.2's "shared" layers (config.json's `indexer_types`) have no indexer: they attend over the keys the last
"full" layer before them chose, as transformers hands `prev_topk_indices` from layer to layer. Here the full
layer leaves its choice (per query of this rank's CP chunk) in a relay the next shared layers read; the layers
of one forward run in order, so the relay holds the right choice as long as a shared layer and its source are
built in the same pipeline chunk and recomputed together (checked before Ray starts: glm_moe_dsa.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from slime.models import indexer_loss
from slime.models.cp_attention import AttentionPlan, ContextParallelAttention, all_gather_sequence, attention_plan

logger = logging.getLogger(__name__)


def rope_frequencies(config) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rope_dim / 2], factor on cos and sin) of the MLA's rotary embedding, as transformers'
    rotary embedding of the model gives the indexer: the default one, or YaRN's (interpolated frequencies, the
    attention factor mscale / mscale_all_dim, or 0.1 ln(factor) + 1 without both)."""
    dim, base = config.qk_pos_emb_head_dim, float(config.rotary_base)
    exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
    extrapolated = 1.0 / base ** exponents
    if getattr(config, "rope_type", "rope") != "yarn":
        return extrapolated, 1.0
    factor = float(config.rotary_scaling_factor)
    original = config.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(config.beta_fast)), 0)
    high = min(math.ceil(correction_dim(config.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / ((high - low) or 0.001)).clamp(0, 1)
    frequencies = extrapolated / factor * ramp + extrapolated * (1 - ramp)

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    both = config.mscale and config.mscale_all_dim
    return frequencies, (mscale(config.mscale) / mscale(config.mscale_all_dim) if both else mscale(1.0))


class LightningIndexer(torch.nn.Module):
    """The indexer's projections (replicated over TP, frozen): HF names wq_b, wk, k_norm, weights_proj.
    `rope_interleaved`: RoPE on interleaved pairs (GLM-5), else on two halves (DeepSeek-V3.2)."""

    def __init__(self, config, rope_interleaved: bool = True) -> None:
        super().__init__()
        heads, dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.heads, self.dim, self.topk = heads, dim, config.dsa_indexer_topk
        self.rope_dim, self.rope_interleaved = config.qk_pos_emb_head_dim, rope_interleaved
        self.inv_freq, self.rope_factor = rope_frequencies(config)  # a tensor, not a buffer: kept fp32
        self.wq_b = torch.nn.Linear(config.q_lora_rank, heads * dim, bias=False)
        self.wk = torch.nn.Linear(config.hidden_size, dim, bias=False)
        self.k_norm = torch.nn.LayerNorm(dim, eps=1e-6)
        self.weights_proj = torch.nn.Linear(config.hidden_size, heads, bias=False)
        dtype = config.params_dtype
        trained = bool(getattr(config, "dsa_indexer_loss_coeff", None))
        for param in self.parameters():
            param.data = param.data.to(dtype)
            param.requires_grad_(trained)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE on the first rope_dim dimensions: on interleaved pairs, the rotated pairs laid out as [evens | odds]
        (transformers' layout; q and k share it, so the dot products are RoPE's), or on two halves."""
        rot, rest = x.split([self.rope_dim, self.dim - self.rope_dim], dim=-1)
        angles = positions.float()[:, None] * self.inv_freq.to(x.device)
        shape = (angles.shape[0],) + (1,) * (x.dim() - 2) + (angles.shape[1],)
        cos = (angles.cos() * self.rope_factor).view(shape).to(x.dtype)
        sin = (angles.sin() * self.rope_factor).view(shape).to(x.dtype)
        first, second = (rot[..., 0::2], rot[..., 1::2]) if self.rope_interleaved else rot.chunk(2, dim=-1)
        return torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)

    def queries_and_keys(self, x, q_latent, positions):
        """Local tokens -> (q [t, H, D], head weights [t, H], k [t, D])."""
        q = self._rope(self.wq_b(q_latent).view(-1, self.heads, self.dim), positions)
        k = self._rope(self.k_norm(self.wk(x)), positions)
        weights = self.weights_proj(x).float() * self.heads ** -0.5
        return q, weights, k

    def scores(self, q, weights, keys, query_pos) -> tuple[torch.Tensor, torch.Tensor]:
        """([tq, L] scores, [tq, L] causal mask) of the queries of one sequence against its keys."""
        key_pos = torch.arange(keys.shape[0], device=keys.device)
        causal = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
        scaled_keys = keys.float().t() * self.dim ** -0.5
        scores = torch.zeros(causal.shape, dtype=torch.float, device=keys.device)
        for head in range(self.heads):  # head by head: [tq, L] at a time, not [tq, H, L]
            scores = scores + weights[:, head, None] * F.relu(q[:, head].float() @ scaled_keys)
        return scores, causal

    def choose(self, scores: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        """[tq, L] boolean: the causal keys among the top-k scored ones."""
        top = scores.detach().masked_fill(~causal, float("-inf")).topk(min(self.topk, causal.shape[-1]), dim=-1).indices
        return causal & torch.zeros_like(causal).scatter_(-1, top, True)

    def select(self, q, weights, keys, query_pos) -> torch.Tensor:
        """[tq, L] boolean: the causal keys among the top-k scored ones for each query of one sequence."""
        return self.choose(*self.scores(q, weights, keys, query_pos))


class _SelectionRelay:
    """The last full indexer layer's choice ([tq, L] masks per sequence) and the plan it was made for."""

    def __init__(self) -> None:
        self.plan: AttentionPlan | None = None
        self.allowed: list[torch.Tensor] = []

    def put(self, plan: AttentionPlan, allowed: list[torch.Tensor]) -> None:
        self.plan, self.allowed = plan, allowed

    def take(self, plan: AttentionPlan) -> list[torch.Tensor]:
        if self.plan is not plan:
            raise RuntimeError("a shared DSA layer ran without the choice of a full indexer layer for these sequences "
                               "before it (indexer_types must start with 'full'; a shared layer's source must be in "
                               "its pipeline stage)")
        return self.allowed


# one per process: a forward runs its layers one after the other (see the module's docstring)
_RELAY = _SelectionRelay()


def _tokens_first(t: torch.Tensor) -> torch.Tensor:
    """[s, b, d] -> [b * s, d] (the fold of ContextParallelAttention); a packed [t, d] / [t, 1, d] -> [t, d]."""
    return t if t.dim() == 2 else t.transpose(0, 1).reshape(-1, t.shape[-1])


class SparseContextParallelAttention(ContextParallelAttention):
    """ContextParallelAttention whose causal mask keeps only the indexer's top-k keys per query.

    The layer's normalised input and MLA's q latent arrive through `indexer_inputs`, set by
    SparseLatentSelfAttention right before this module runs (megatron's MLA passes them to its own DSA only
    when experimental_attention_variant is "dsa", which megatron-core refuses under CP)."""

    def __init__(self, config, *args, indexer_rope_interleaved: bool = True, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.indexer = LightningIndexer(config, rope_interleaved=indexer_rope_interleaved)
        self.indexer_inputs = None
        self.indexer_scores = None  # ([tq, L] scores, causal masks) per sequence, for the KL loss while it trains

    def _attend_packed(self, q, k, v, lengths, group, cp_size, cp_rank) -> torch.Tensor:
        plan = attention_plan(tuple(lengths), cp_size, cp_rank, q.device)
        self.indexer_scores = None
        with torch.set_grad_enabled(self._trains_indexer()):
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
        out = torch.cat(outputs)
        if self.indexer_scores is None:
            return out
        (scores, causal), self.indexer_scores = self.indexer_scores, None
        counted = allowed if getattr(self.config, "dsa_indexer_use_sparse_loss", False) else causal
        loss = indexer_loss.indexer_kl(scores, [q[seq.local] for seq in plan.sequences],
                                       [k[seq.keys] for seq in plan.sequences], counted, self.softmax_scale,
                                       parallel_state.get_tensor_model_parallel_group())
        return indexer_loss.attach(out, loss * self.config.dsa_indexer_loss_coeff)

    def _trains_indexer(self) -> bool:
        """The indexer's KL loss runs: training with a gradient, --dsa-indexer-loss-coeff set."""
        return bool(getattr(self.config, "dsa_indexer_loss_coeff", None)) and self.training and \
            torch.is_grad_enabled()

    def _allowed(self, plan: AttentionPlan, group) -> list[torch.Tensor]:
        if self.indexer_inputs is None:
            raise RuntimeError("sparse attention ran without the indexer's inputs (SparseLatentSelfAttention sets "
                               "them); build GLM-5 layers with glm_moe_dsa.dsa_layer_spec")
        x, q_latent = (t.detach() for t in self.indexer_inputs)  # the KL loss trains the indexer only
        self.indexer_inputs = None
        if self.config.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
            x, q_latent = gather_from_sequence_parallel_region(x), gather_from_sequence_parallel_region(q_latent)
        positions = torch.cat(plan.query_positions)
        q, weights, k = self.indexer.queries_and_keys(_tokens_first(x), _tokens_first(q_latent), positions)
        if group is not None:  # the indexer's keys of the whole sequence, as the attention's K/V (differentiable)
            k = all_gather_sequence(k.contiguous(), group).index_select(0, plan.key_order)
        scored = [self.indexer.scores(q[seq.local], weights[seq.local], k[seq.keys], pos)
                  for seq, pos in zip(plan.sequences, plan.query_positions)]
        allowed = [self.indexer.choose(scores, causal) for scores, causal in scored]
        if torch.is_grad_enabled():  # the KL loss's inputs (_attend_packed)
            self.indexer_scores = [scores for scores, _ in scored], [causal for _, causal in scored]
        _RELAY.put(plan, allowed)
        return allowed


class SharedSelectionAttention(SparseContextParallelAttention):
    """A "shared" DSA layer (GLM-5.2): no indexer of its own; the keys the last full layer chose."""

    def __init__(self, config, *args, **kwargs):
        ContextParallelAttention.__init__(self, config, *args, **kwargs)
        self.indexer_inputs = None
        self.indexer_scores = None

    def _allowed(self, plan: AttentionPlan, group) -> list[torch.Tensor]:
        self.indexer_inputs = None
        return _RELAY.take(plan)


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


def with_sparse_attention(spec, shared: bool = False, indexer_rope_interleaved: bool = True):
    """A local MLA layer spec (deepseek_v3.mla_layer_spec) with DSA's attention modules; `shared`: a layer
    reusing the last full layer's choice (no indexer); `indexer_rope_interleaved` False: the indexer's RoPE on two
    halves (DeepSeek-V3.2)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    attention = spec.submodules.self_attention
    core = SharedSelectionAttention if shared else SparseContextParallelAttention
    if not indexer_rope_interleaved:
        core = ModuleSpec(module=core, params={"indexer_rope_interleaved": False})
    sub = dataclasses.replace(attention.submodules, core_attention=core)
    attention = dataclasses.replace(attention, module=sparse_latent_attention(attention.module), submodules=sub)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))
