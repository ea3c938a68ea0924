"""HF (Qwen3/Qwen2/Llama dense) <-> megatron-core GPTModel weights, TP/PP-sharded.

Each megatron parameter maps to one or more HF tensors through a `_Mapping` that converts in
both directions between the HF tensors and the FULL (unsharded) megatron tensor. TP sharding
is then generic: megatron marks every TP-split parameter with `tensor_model_parallel` and
`partition_dim`, and a full megatron-layout tensor splits into equal contiguous chunks.

megatron layouts that differ from HF:
- linear_qkv: rows grouped per query group g: [q heads of g | k_g | v_g] (so a TP shard of
  whole groups is contiguous).
- linear_fc1: TP rank r holds [gate_r; up_r]; the full tensor is the concatenation over r.
- vocabulary rows padded with zeros to the model's padded vocab size.
Both local-spec names (input_layernorm) and TE-spec names (linear_qkv.layer_norm_weight) are handled.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open

from slime_plugins.models import deepseek_v3, glm4


@dataclass(frozen=True)
class _Shapes:
    """Sizes the layout conversions need (from the HF config)."""

    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_groups


def _shapes(hf_config: Any) -> _Shapes:
    heads = hf_config.num_attention_heads
    return _Shapes(
        num_heads=heads,
        num_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        vocab_size=hf_config.vocab_size,
    )


@dataclass(frozen=True)
class _Mapping:
    """HF names for one megatron parameter and the conversions full megatron <-> HF tensors."""

    hf_names: tuple[str, ...]
    to_megatron: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]


def _identity(hf_name: str) -> _Mapping:
    return _Mapping((hf_name,), lambda ts: ts[0], lambda t: [t])


def _vocab(hf_name: str, shapes: _Shapes, padded_rows: int) -> _Mapping:
    def to_megatron(ts):
        full = ts[0].new_zeros((padded_rows, ts[0].shape[1]))
        full[: shapes.vocab_size] = ts[0]
        return full

    return _Mapping((hf_name,), to_megatron, lambda t: [t[: shapes.vocab_size]])


def _qkv(prefix: str, suffix: str, shapes: _Shapes) -> _Mapping:
    g, hpg, d = shapes.num_groups, shapes.heads_per_group, shapes.head_dim

    def to_megatron(ts):
        q, k, v = ts
        rest = q.shape[1:]
        grouped = torch.cat([q.reshape(g, hpg * d, *rest), k.reshape(g, d, *rest),
                             v.reshape(g, d, *rest)], dim=1)
        return grouped.reshape(g * (hpg + 2) * d, *rest)

    def to_hf(t):
        rest = t.shape[1:]
        grouped = t.reshape(g, (hpg + 2) * d, *rest)
        q, k, v = grouped.split([hpg * d, d, d], dim=1)
        return [q.reshape(g * hpg * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)]

    names = tuple(f"{prefix}self_attn.{p}_proj.{suffix}" for p in ("q", "k", "v"))
    return _Mapping(names, to_megatron, to_hf)


def _gate_up(prefix: str, tp: int) -> _Mapping:
    def to_megatron(ts):
        gate, up = (t.chunk(tp, dim=0) for t in ts)
        return torch.cat([torch.cat([gr, ur]) for gr, ur in zip(gate, up)])

    def to_hf(t):
        per_rank = [c.chunk(2, dim=0) for c in t.chunk(tp, dim=0)]
        return [torch.cat([gr for gr, _ in per_rank]), torch.cat([ur for _, ur in per_rank])]

    return _Mapping((f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"), to_megatron, to_hf)


def _row_fused(hf_name: str, parts: _Mapping) -> _Mapping:
    """`parts` with its equally sized HF tensors stored as one, concatenated along rows."""
    return _Mapping((hf_name,), lambda ts: parts.to_megatron(list(ts[0].chunk(len(parts.hf_names)))),
                    lambda t: [torch.cat(parts.to_hf(t))])


_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _layer_mapping(suffix: str, prefix: str, shapes: _Shapes, tp: int, hf_config: Any) -> _Mapping:
    table = {
        "input_layernorm.weight": f"{prefix}input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight": f"{prefix}input_layernorm.weight",
        "self_attention.q_layernorm.weight": f"{prefix}self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": f"{prefix}self_attn.k_norm.weight",
        "self_attention.linear_proj.weight": f"{prefix}self_attn.o_proj.weight",
        "pre_mlp_layernorm.weight": f"{prefix}post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": f"{prefix}post_attention_layernorm.weight",
        "mlp.linear_fc2.weight": f"{prefix}mlp.down_proj.weight",
    }
    if deepseek_v3.is_mla(hf_config):
        table.update(deepseek_v3.attention_names(prefix))
    if glm4.is_glm4(hf_config):
        table.update(glm4.layer_names(prefix))
    if suffix in table:
        return _identity(table[suffix])
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return _qkv(prefix, suffix.rsplit(".", 1)[1], shapes)
    if suffix == "mlp.linear_fc1.weight":
        gate_up = _gate_up(prefix, tp)
        return _row_fused(glm4.fused_gate_up_name(prefix), gate_up) if glm4.is_glm4(hf_config) else gate_up
    raise KeyError(f"no HF mapping for layer parameter {suffix!r}")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):  # DDP / Float16Module wrappers
        chunk = chunk.module
    return chunk


def _tied(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def _mapping_for(model: torch.nn.Module, name: str, param: torch.Tensor, hf_config: Any,
                 tp: int) -> _Mapping | None:
    """The mapping of one megatron parameter, or None if it has no HF counterpart of its own."""
    shapes = _shapes(hf_config)
    padded_rows = param.shape[0] * (tp if getattr(param, "tensor_model_parallel", False) else 1)
    if name == "embedding.word_embeddings.weight":
        return _vocab("model.embed_tokens.weight", shapes, padded_rows)
    if name == "output_layer.weight":
        return _vocab("model.embed_tokens.weight" if _tied(hf_config) else "lm_head.weight",
                      shapes, padded_rows)
    if name == "decoder.final_layernorm.weight":
        return _identity("model.norm.weight")
    match = _LAYER_NAME.match(name)
    if match is None:
        raise KeyError(f"no HF mapping for parameter {name!r}")
    global_layer = model.decoder.layers[int(match.group(1))].layer_number - 1
    return _layer_mapping(match.group(2), f"model.layers.{global_layer}.", shapes, tp, hf_config)


def _tp() -> tuple[int, int, Any]:
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_group())


class HFCheckpointError(ValueError):
    """The HF checkpoint's tensors do not match its config (missing, mis-shaped or unreadable files)."""


class _SafetensorsReader:
    """Reads named tensors from an HF checkpoint dir (single file or index-sharded)."""

    def __init__(self, hf_dir: str):
        index_path = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(hf_dir, "model.safetensors")):
            with safe_open(os.path.join(hf_dir, "model.safetensors"), framework="pt") as f:
                weight_map = {key: "model.safetensors" for key in f.keys()}
        else:
            raise HFCheckpointError(f"--hf-checkpoint {hf_dir} holds neither model.safetensors nor "
                                    "model.safetensors.index.json; convert the weights to safetensors")
        self._dir, self._weight_map = hf_dir, weight_map
        missing_files = sorted({f for f in weight_map.values() if not os.path.exists(os.path.join(hf_dir, f))})
        if missing_files:
            raise HFCheckpointError(f"--hf-checkpoint {hf_dir}: the index names files that are not there: "
                                    f"{missing_files[:5]}; copy every shard of the checkpoint")

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The tensor's shape from the file header (no data read); None when the checkpoint lacks it."""
        if name not in self._weight_map:
            return None
        with safe_open(os.path.join(self._dir, self._weight_map[name]), framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name not in self._weight_map:
            raise KeyError(f"{name} not found in {self._dir}")
        with safe_open(os.path.join(self._dir, self._weight_map[name]), framework="pt") as f:
            return f.get_tensor(name)


def _expected_hf_shapes(model: torch.nn.Module, hf_config: Any, tp: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(hf name, full shape) of every HF tensor this model chunk loads, from meta tensors (no data)."""
    for name, param in model.named_parameters():
        shape = list(param.shape)
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            shape[param.partition_dim] *= tp
        mapping = _mapping_for(model, name, param, hf_config, tp)
        full = torch.empty(shape, dtype=param.dtype, device="meta")
        yield from ((n, tuple(t.shape)) for n, t in zip(mapping.hf_names, mapping.to_hf(full)))


def check_hf_tensors(model_chunks: list[torch.nn.Module], reader: _SafetensorsReader, hf_config: Any, tp: int) -> None:
    """Raise HFCheckpointError listing every missing or mis-shaped tensor, before anything is loaded."""
    missing, misshaped = [], []
    for chunk in model_chunks:
        for name, expected in _expected_hf_shapes(_unwrap(chunk), hf_config, tp):
            found = reader.shape(name)
            if found is None:
                missing.append(name)
            elif found != expected:
                misshaped.append(f"{name}: file {found}, config expects {expected}")
    if not missing and not misshaped:
        return
    parts = [f"{len(missing)} missing ({missing[:4]}{' ...' if len(missing) > 4 else ''})"] if missing else []
    parts += [f"{len(misshaped)} mis-shaped ({'; '.join(misshaped[:3])}{' ...' if len(misshaped) > 3 else ''})"] \
        if misshaped else []
    raise HFCheckpointError(
        f"--hf-checkpoint {reader._dir} does not match its config.json (hidden_size={hf_config.hidden_size}, "
        f"num_hidden_layers={hf_config.num_hidden_layers}, vocab_size={hf_config.vocab_size}): tensors "
        f"{' and '.join(parts)}; point --hf-checkpoint at a complete checkpoint of that architecture")


@torch.no_grad()
def load_hf_weights(model_chunks: list[torch.nn.Module], hf_dir: str, hf_config: Any) -> None:
    """Fill this rank's shards of every parameter from the HF safetensors in hf_dir.

    Purely local (no collectives): each rank reads what it needs. Call after
    init_model_parallel and model construction.
    """
    tp, tp_rank, _ = _tp()
    reader = _SafetensorsReader(hf_dir)
    check_hf_tensors(model_chunks, reader, hf_config, tp)
    for chunk in model_chunks:
        model = _unwrap(chunk)
        for name, param in model.named_parameters():
            mapping = _mapping_for(model, name, param, hf_config, tp)
            full = mapping.to_megatron([reader.get(n) for n in mapping.hf_names])
            if getattr(param, "tensor_model_parallel", False):
                full = full.chunk(tp, dim=param.partition_dim)[tp_rank]
            if full.shape != param.shape:
                raise ValueError(f"{name}: HF gives {tuple(full.shape)}, model has {tuple(param.shape)}")
            param.copy_(full.to(param.dtype))


def _gather_tp(shard: torch.Tensor, partition_dim: int, tp: int, group: Any) -> torch.Tensor:
    """Full tensor of a TP-split parameter (collective over the TP group)."""
    shards = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(shards, shard.contiguous(), group=group)
    return torch.cat(shards, dim=partition_dim)


@torch.no_grad()
def export_hf_weights(model_chunks: list[torch.nn.Module], hf_config: Any,
                      read_param: Callable[[torch.Tensor], torch.Tensor] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for this PP stage's parameters, in a fixed order.

    Order: model chunks in order, then each chunk's named_parameters() order (identical on all
    ranks of a stage); layer names use GLOBAL layer indices. Every rank of a TP group must
    iterate it to the end together (one all_gather over the TP group per TP-split parameter);
    ranks of different DP/CP replicas or PP stages are independent. With tied embeddings the
    last stage's output_layer copy is skipped (HF ties lm_head to embed_tokens). `read_param` gives
    a parameter's value (default: the live tensor; a sleeping trainer serves its host copy).
    """
    read = read_param or (lambda param: param.detach())
    tp, _, tp_group = _tp()
    for chunk in model_chunks:
        model = _unwrap(chunk)
        for name, param in model.named_parameters():
            if name == "output_layer.weight" and _tied(hf_config):
                continue
            full = read(param)
            if tp > 1 and getattr(param, "tensor_model_parallel", False):
                full = _gather_tp(full, param.partition_dim, tp, tp_group)
            mapping = _mapping_for(model, name, param, hf_config, tp)
            yield from zip(mapping.hf_names, mapping.to_hf(full))
