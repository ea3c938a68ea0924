"""DeepSeek-V4's MoE routers as megatron-core routers (MoESubmodules.router), on megatron's MoE layer.

transformers' DeepseekV4TopKRouter (`moe` layers): scores = sqrt(softplus(logits)); the top-k is chosen on
scores + e_score_correction_bias (megatron's expert_bias, moved by --moe-router-bias-update-rate as for
DeepSeek-V3); the chosen experts' unbiased scores are renormalised over the k (always, whatever
norm_topk_prob says) and scaled by routed_scaling_factor. megatron-core 0.16 names only softmax and sigmoid scores,
so `routing` is this module's; the token counts behind the expert-bias update and the z-loss are megatron's.

DeepseekV4HashRouter (`hash_moe` layers): the experts are a frozen table's row of the token id (HF
`ffn.gate.tid2eid` [vocab, k]), weighted as above by their sqrt(softplus) scores; no bias. The router needs each
token's id: `feed_token_ids` hooks the model so that every forward hands its input ids to the hash routers, which
take the rows of this rank's tokens (the sequence shard of SP; CP's zig-zag slice is already the model's input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter


def sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    return F.softplus(logits.float()).sqrt()


def _routing(scores: torch.Tensor, chosen: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """([tokens, E] probabilities, [tokens, E] boolean map) of the chosen experts, weighted by their scores."""
    weights = scores.gather(1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scale:
        weights = weights * scale
    probs = torch.zeros_like(scores).scatter(1, chosen, weights)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, chosen, True)
    return probs, routing_map


class _V4Router(TopKRouter):
    def __init__(self, config, pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        if self.router_replay is not None or self.is_aux_loss_enabled() or \
                config.moe_expert_capacity_factor is not None:
            raise ValueError("DeepSeek-V4's routers do not build routing replay, megatron's aux losses or token "
                             "dropping (refused before Ray starts)")

    def routing(self, logits: torch.Tensor, padding_mask=None):
        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        probs, routing_map = _routing(sqrt_softplus(logits), self.choose(logits),
                                      self.config.moe_router_topk_scaling_factor)
        if self.enable_expert_bias:
            self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs.type_as(logits), routing_map

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class SqrtSoftplusRouter(_V4Router):
    """A `moe` layer's router (HF `ffn.gate.weight`, `ffn.gate.bias` as the expert bias)."""

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        scores = sqrt_softplus(logits)
        if self.expert_bias is not None:
            scores = scores + self.expert_bias
        return torch.topk(scores, k=self.topk, dim=1).indices


class HashRouter(_V4Router):
    """A `hash_moe` layer's router (HF `ffn.gate.weight`, `ffn.gate.tid2eid`): no expert bias."""

    def __init__(self, config, pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        if self.enable_expert_bias:  # the config's bias is the `moe` layers'; a hash layer has none
            del self.expert_bias, self.local_tokens_per_expert
            self.enable_expert_bias = False
        layers = config.hf_layer_config
        # until a checkpoint's table is loaded: token t to experts t, t + 1, ... (distinct, every expert used)
        table = (torch.arange(layers.vocab_size)[:, None] + torch.arange(layers.topk)[None]) % self.num_experts
        self.register_buffer("tid2eid", table.to(self.weight.device))
        self.token_ids: _TokenIds | None = None
        self._checked_version: int | None = None

    def _check_table(self) -> None:
        """Each token's experts distinct and in range (checked again after every write of the table): transformers'
        class runs an expert listed twice twice, megatron's MoE layer once."""
        if self._checked_version == self.tid2eid._version:
            return
        table = self.tid2eid
        rows = table.sort(dim=-1).values
        wrong = (rows[:, 1:] == rows[:, :-1]).any(-1) | (table < 0).any(-1) | (table >= self.num_experts).any(-1)
        if wrong.any():
            bad = int(wrong.nonzero()[0])
            raise ValueError(f"DeepSeek-V4 hash layer {self.layer_number}: tid2eid row {bad} is {table[bad].tolist()}; "
                             f"each token needs {table.shape[1]} distinct experts of the {self.num_experts}: fix the "
                             "checkpoint's ffn.gate.tid2eid")
        self._checked_version = table._version

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        self._check_table()
        if self.token_ids is None or self.token_ids.value is None:
            raise RuntimeError("a DeepSeek-V4 hash router ran without the forward's token ids; build the model with "
                               "build_gpt_model (the family's prepare_model feeds them)")
        ids = self.token_ids.value.transpose(0, 1)  # [s, b] as the hidden states
        if self.config.sequence_parallel:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            ids = ids.chunk(tp, dim=0)[parallel_state.get_tensor_model_parallel_rank()]
        ids = ids.reshape(-1)
        if ids.numel() != logits.shape[0]:
            raise RuntimeError(f"a DeepSeek-V4 hash router has {ids.numel()} token ids for {logits.shape[0]} tokens")
        return self.tid2eid[ids.to(self.tid2eid.device)]


class _TokenIds:
    """The input ids of the forward in progress ([b, s] as the model got them)."""

    value: torch.Tensor | None = None


def feed_token_ids(model: torch.nn.Module) -> None:
    """Hand each forward's input ids to the model's hash routers (ModelFamily.prepare_model)."""
    routers = [m for m in model.modules() if isinstance(m, HashRouter)]
    if not routers:
        return
    holder = _TokenIds()
    for router in routers:
        router.token_ids = holder

    def keep(module, args, kwargs):
        holder.value = args[0] if args else kwargs.get("input_ids")

    model.register_forward_pre_hook(keep, with_kwargs=True)
