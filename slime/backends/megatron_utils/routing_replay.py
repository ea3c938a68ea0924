"""Routing replay: the trainer's MoE routers take given experts instead of their own top-k.

--use-rollout-routing-replay: the experts the rollout engine routed each token to (meta_info.routed_experts),
  in the old-policy / reference log-prob forwards and the training forward, so the trainer scores the
  tokens through the same experts that generated them.
--use-routing-replay: the experts the trainer's own old-policy forward chose, replayed in the training
  forward (the policy-gradient ratio then compares one expert path, not two).

megatron-core's RouterReplay does the replaying (one instance per local MoE layer, in build order);
this module lays the routes out as each router sees its tokens: packed per micro-batch, the CP rank's
zig-zag slice, then the TP rank's sequence-parallel chunk. No collectives: every rank derives its own
slice from the rollout data (or from what it recorded itself), so the step's collective order is unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Sequence

import torch

from slime.backends.megatron_utils.data import pad_multiple_for, round_up, zigzag_slice
from slime.models.moe_hf import decode_routes


class RoutingReplayError(RuntimeError):
    """Routes to replay are missing or do not fit the micro-batch."""


def replay_mode(args: Any) -> str | None:
    if args.use_rollout_routing_replay:
        return "rollout"
    if args.use_routing_replay:
        return "recorded"
    return None


def _instances():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return RouterReplay


def _moe_layers(model_chunks: Sequence[Any]) -> list[int]:
    """Global MoE-layer ordinal of each local router, in build order (= RouterReplay's order)."""
    ordinals = []
    for chunk in model_chunks:
        module = chunk
        while hasattr(module, "module"):
            module = module.module
        config = module.config
        pattern = config.moe_layer_freq
        for layer in module.decoder.layers:
            if hasattr(layer.mlp, "router"):
                index = layer.layer_number - 1
                ordinals.append(sum(pattern[:index]))
    return ordinals


def _sequence_routes(encoded: Any, total: int, padded: int, num_layers: int, topk: int) -> torch.Tensor:
    """[padded, num_layers, topk] for one sample: the engine's rows for positions 0..total-2; the last token
    and the padding (whose outputs no loss reads) get experts 0..k-1."""
    routes = torch.as_tensor(decode_routes(encoded, num_layers, topk).copy())
    if routes.shape[0] < total - 1:
        raise RoutingReplayError(f"the engine's routes cover {routes.shape[0]} tokens, the sample has {total}")
    out = torch.arange(topk, dtype=torch.int32).expand(padded, num_layers, topk).clone()
    out[: total - 1] = routes[: total - 1]
    return out


def pack_rollout_routes(data: Mapping[str, Any], sample_ids: Sequence[int], *, cp_size: int, cp_rank: int,
                        tp_size: int, tp_rank: int, sequence_parallel: bool, num_layers: int, topk: int
                        ) -> torch.Tensor:
    """This rank's routes [local tokens, num_layers, topk] of one micro-batch, in the packed token order."""
    encoded = data.get("rollout_routed_experts")
    if encoded is None:
        raise RoutingReplayError("--use-rollout-routing-replay: the rollout carries no routed experts")
    multiple = pad_multiple_for(cp_size, tp_size, sequence_parallel)
    pieces = []
    for i in sample_ids or ():
        total = len(data["tokens"][i])
        full = _sequence_routes(encoded[i], total, round_up(total, multiple), num_layers, topk)
        pieces.append(zigzag_slice(full, cp_size, cp_rank))
    if not pieces:  # a padding micro-batch: one dummy sequence of `multiple` tokens
        pieces.append(torch.arange(topk, dtype=torch.int32).expand(multiple // cp_size, num_layers, topk).clone())
    local = torch.cat(pieces)
    return local.chunk(tp_size)[tp_rank] if sequence_parallel and tp_size > 1 else local


class RouteReplayer:
    """Sets, per micro-batch, what each local router replays (or records), for one forward pass."""

    _recorded: dict[tuple[int, ...], list[torch.Tensor]] = {}  # sample ids -> per local layer [tokens, k]

    def __init__(self, args: Any, model_chunks: Sequence[Any], data: Mapping[str, Any], *, training: bool):
        from megatron.core import parallel_state as mpu
        from megatron.core.utils import get_model_config

        self.mode = replay_mode(args)
        self.data = data
        self.training = training
        config = get_model_config(model_chunks[0])
        self.layers = _moe_layers(model_chunks) if self.mode and config.num_moe_experts else []
        self.topk = config.moe_router_topk
        self.num_moe_layers = sum(config.moe_layer_freq) if self.layers else 0
        self.layout = dict(cp_size=mpu.get_context_parallel_world_size(), cp_rank=mpu.get_context_parallel_rank(),
                           tp_size=mpu.get_tensor_model_parallel_world_size(),
                           tp_rank=mpu.get_tensor_model_parallel_rank(),
                           sequence_parallel=bool(args.sequence_parallel))
        if self.mode == "recorded" and not training:
            RouteReplayer._recorded.clear()  # a new old-policy pass: the previous rollout's routes are stale

    @property
    def active(self) -> bool:
        return bool(self.mode and self.layers)

    def before_forward(self, sample_ids: tuple[int, ...]) -> None:
        if not self.active:
            return
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replay = _instances()
        if self.mode == "recorded" and not self.training:
            replay.set_global_router_replay_action(RouterReplayAction.RECORD)
            return
        replay.clear_global_indices()
        replay.set_replay_data(self._routes(sample_ids))
        replay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self, sample_ids: tuple[int, ...]) -> None:
        if self.active and self.mode == "recorded" and not self.training:
            RouteReplayer._recorded[tuple(sample_ids)] = [t.detach().clone() for t in _instances().get_recorded_data()]

    def _routes(self, sample_ids: tuple[int, ...]) -> list[torch.Tensor]:
        if self.mode == "recorded":
            routes = RouteReplayer._recorded.get(tuple(sample_ids))
            if routes is None:
                raise RoutingReplayError(
                    f"--use-routing-replay: no recorded routes for the micro-batch of samples {list(sample_ids)}; "
                    "the training micro-batches must be the old-policy pass's (leave --log-probs-max-tokens-per-gpu "
                    "unset, or use --use-rollout-routing-replay)")
            return routes
        routes = pack_rollout_routes(self.data, sample_ids, num_layers=self.num_moe_layers, topk=self.topk,
                                     **self.layout)
        return [routes[:, layer].long() for layer in self.layers]

    def done(self) -> None:
        if self.active:
            _instances().clear_global_router_replay_action()
            _instances().clear_global_indices()
