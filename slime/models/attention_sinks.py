"""Attention with a learned sink per head (gpt-oss), on this project's CP/THD core attention, in pure torch.

Each head h has one learned logit s_h that joins every query's softmax as an extra column whose value is zero:

    p(t, j) = exp(l(t, j)) / (exp(s_h) + sum_k exp(l(t, k)))        out(t) = sum_j p(t, j) v_j

so the weights of the real keys sum to less than one (a query may attend to "nothing"). transformers'
GptOssAttention (the reference) appends the sink column to the scaled, masked logits and drops it after the
softmax; megatron-core names the parameter `softmax_offset` (its softmax_type "learnable"), as it is here.

The attention runs over the plan ContextParallelAttention makes (zig-zag CP chunks, packed sequences, sliding
windows): each query chunk against the keys it may see, with explicit scores ([heads, queries, keys] per chunk,
fp32 softmax), since the fused kernels this project calls take no sink. The sinks are split over TP with the
heads (`softmax_offset` [local heads]); their gradient comes from this rank's heads and tokens, and megatron's
gradient reduction sums it over DP x CP like any weight's.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from slime.models.cp_attention import ContextParallelAttention, all_gather_sequence, attention_plan


def sink_chunk_attention(q, k, v, sinks, first: int, window: int | None, *, scale: float,
                         dropout_p: float) -> torch.Tensor:
    """q [tq, hq, d] whose first query sits at position `first` of keys k/v [tk, hkv, d] (position 0 = key 0);
    query i sees keys j <= first + i (and first + i - j < window); sinks [hq]. -> [tq, hq, d]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # query head h reads kv head h // groups, as megatron and transformers
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    gap = (torch.arange(q.shape[0], device=q.device) + first).unsqueeze(1) - torch.arange(k.shape[0], device=q.device)
    allowed = gap >= 0 if window is None else (gap >= 0) & (gap < window)
    logits = logits.masked_fill(~allowed, float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    if dropout_p:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    return torch.einsum("hqk,khd->qhd", probs.to(v.dtype), v)


class SinkAttention(ContextParallelAttention):
    """ContextParallelAttention whose softmax has each head's learned sink (HF `self_attn.sinks`)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        tp = config.tensor_model_parallel_size
        if config.num_attention_heads % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide the {config.num_attention_heads} "
                             "attention heads whose sinks it splits")
        self.softmax_offset = torch.nn.Parameter(torch.zeros(config.num_attention_heads // tp,
                                                             dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

    def _attend_packed(self, q, k, v, lengths, group, cp_size, cp_rank) -> torch.Tensor:
        if group is not None:
            kv = all_gather_sequence(torch.cat([k, v], dim=-1), group)
            k, v = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        plan = attention_plan(tuple(lengths), cp_size, cp_rank, q.device)
        if plan.key_order is not None:
            k, v = k.index_select(0, plan.key_order), v.index_select(0, plan.key_order)
        dropout_p = self.attention_dropout if self.training else 0.0
        outputs = []
        with self._dropout_rng():
            for seq in plan.sequences:
                keys, values = k[seq.keys], v[seq.keys]
                for queries, prefix in seq.query_chunks:
                    first = prefix - (queries.stop - queries.start)  # the chunk's first query's position
                    start = 0 if self.window is None else max(0, first - self.window + 1)
                    outputs.append(sink_chunk_attention(q[queries], keys[start:prefix], values[start:prefix],
                                                        self.softmax_offset, first - start, self.window,
                                                        scale=self.softmax_scale, dropout_p=dropout_p))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        # split over TP with the heads (megatron's default would take the parameter as replicated)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                   {"softmax_offset": 0}, sharded_offsets)
