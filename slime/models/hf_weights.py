"""HF <-> megatron-core GPTModel weights, TP/PP-sharded: the mapping machinery every model family shares.

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
What a family names otherwise (MLA's attention, GLM-4's post norms and fused gate_up) comes from its
ModelFamily (slime/models/registry.py: layer_names, fused_gate_up).
MoE layers (router, routed and shared experts) take their names from the family (ModelFamily.moe_names);
routed experts are sharded over expert-parallel ranks (each holds E/EP of them) and over the expert-TP
group instead of TP: load reads only this rank's experts, the export all-gathers them over EP so every
exporter yields all experts, in a fixed order (local expert i of EP rank 0, 1, ..., then i+1).
Multi-token-prediction layers (`mtp.layers.k.`, slime/models/mtp.py) map through the family's `mtp_names`: their
transformer layer with the decoder-layer table under the checkpoint's prefix for it. `mtp=False` (the weight push:
the engines do not run them) leaves them out of the export.
The router's expert bias (DeepSeek-V3's e_score_correction_bias) is a buffer, not a parameter: megatron
updates it outside the optimizer, and it changes routing, so load, save-hf and the push carry it like a
replicated parameter (`_weights`).
A family whose checkpoint stacks a layer's routed experts into one tensor (gpt-oss: `mlp.experts.gate_up_proj`
[E, H, 2I]; ModelFamily.stacked_experts) maps each megatron expert to its row: load reads that row alone, the
export yields the stacked tensor once its last expert (E - 1) is gathered.
An MXFP4 checkpoint (quantization_config quant_method mxfp4) is read as its bf16 checkpoint: its experts'
blocks and scales dequantised on load (slime/models/mxfp4.py); save-hf and the push write bf16.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open

from slime.models import lora, moe_hf, mxfp4
from slime.models.registry import TEXT_PREFIX_ATTRIBUTE, family_of
from slime.models.vision_arch import VISION_ATTRIBUTE, VISION_MODULE

logger = logging.getLogger(__name__)


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
    stacked: tuple[int, int] | None = None
    """(row, rows): the HF tensor stacks `rows` such parameters along dim 0 and the conversions take this one's row
    (a checkpoint's stacked experts); None: the whole tensor."""

    @property
    def row(self) -> int | None:
        return None if self.stacked is None else self.stacked[0]

    @property
    def last_row(self) -> bool:
        """The stacked tensor's last row: where the export yields it (every other row has come before)."""
        return self.stacked is not None and self.stacked[0] == self.stacked[1] - 1


def _identity(hf_name: str) -> _Mapping:
    return _Mapping((hf_name,), lambda ts: ts[0], lambda t: [t])


def _vocab(hf_name: str, shapes: _Shapes, padded_rows: int) -> _Mapping:
    def to_megatron(ts):
        full = ts[0].new_zeros((padded_rows, ts[0].shape[1]))
        full[: shapes.vocab_size] = ts[0]
        return full

    return _Mapping((hf_name,), to_megatron, lambda t: [t[: shapes.vocab_size]])


def _qkv(prefix: str, suffix: str, shapes: _Shapes, gated: bool = False) -> _Mapping:
    """HF q/k/v -> megatron's per-group rows. `gated` (attention output gate): HF q_proj holds [q_h; gate_h] per
    head, megatron [q heads of g | gate heads of g | k_g | v_g] per group."""
    g, hpg, d = shapes.num_groups, shapes.heads_per_group, shapes.head_dim
    q_parts = 2 if gated else 1

    def to_megatron(ts):
        q, k, v = ts
        rest = q.shape[1:]
        per_head = q.reshape(g, hpg, q_parts, d, *rest)
        qs = [per_head[:, :, i].reshape(g, hpg * d, *rest) for i in range(q_parts)]
        grouped = torch.cat([*qs, k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
        return grouped.reshape(g * (q_parts * hpg + 2) * d, *rest)

    def to_hf(t):
        rest = t.shape[1:]
        grouped = t.reshape(g, (q_parts * hpg + 2) * d, *rest)
        *qs, k, v = grouped.split([hpg * d] * q_parts + [d, d], dim=1)
        q = torch.stack([x.reshape(g, hpg, d, *rest) for x in qs], dim=2)
        return [q.reshape(g * hpg * q_parts * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)]

    names = tuple(f"{prefix}self_attn.{p}_proj.{suffix}" for p in ("q", "k", "v"))
    return _Mapping(names, to_megatron, to_hf)


def _gate_up(prefix: str, tp: int, block: str = "mlp") -> _Mapping:
    return _fused_gate_up((f"{prefix}{block}.gate_proj.weight", f"{prefix}{block}.up_proj.weight"), tp)


def _fused_gate_up(names: tuple[str, ...], tp: int) -> _Mapping:
    """[gate; up] of a SwiGLU MLP as megatron's fc1: TP rank r holds [gate_r; up_r]."""
    def to_megatron(ts):
        gate, up = (t.chunk(tp, dim=0) for t in ts)
        return torch.cat([torch.cat([gr, ur]) for gr, ur in zip(gate, up)])

    def to_hf(t):
        per_rank = [c.chunk(2, dim=0) for c in t.chunk(tp, dim=0)]
        return [torch.cat([gr for gr, _ in per_rank]), torch.cat([ur for _, ur in per_rank])]

    return _Mapping(names, to_megatron, to_hf)


def _row_fused(hf_name: str, parts: _Mapping) -> _Mapping:
    """`parts` with its equally sized HF tensors stored as one, concatenated along rows."""
    return _Mapping((hf_name,), lambda ts: parts.to_megatron(list(ts[0].chunk(len(parts.hf_names)))),
                    lambda t: [torch.cat(parts.to_hf(t))])


_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_LAYER_NAME = re.compile(r"^mtp\.layers\.(\d+)\.transformer_layer\.(.+)$")
_MTP_PART_NAME = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


def _layer_mapping(suffix: str, prefix: str, shapes: _Shapes, tp: int, hf_config: Any,
                   global_expert: int | None = None) -> _Mapping:
    family = family_of(hf_config)
    moe_names = family.moe_names(suffix, prefix, global_expert, family.moe(hf_config))
    if moe_names is not None:
        return _fused_gate_up(moe_names, tp) if len(moe_names) == 2 else _identity(moe_names[0])
    if global_expert is not None and family.stacked_experts is not None:
        stacked = family.stacked_experts(suffix, prefix, tp, hf_config)
        if stacked is not None:
            return _Mapping(*stacked, stacked=(global_expert, family.moe(hf_config).num_experts))
    table = {
        "input_layernorm.weight": f"{prefix}input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight": f"{prefix}input_layernorm.weight",
        "self_attention.q_layernorm.weight": f"{prefix}self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": f"{prefix}self_attn.k_norm.weight",
        "self_attention.linear_proj.weight": f"{prefix}self_attn.o_proj.weight",
        "pre_mlp_layernorm.weight": f"{prefix}post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": f"{prefix}post_attention_layernorm.weight",
        "mlp.linear_fc2.weight": f"{prefix}{family.dense_mlp_block}.down_proj.weight",
    }
    table.update(family.layer_names(prefix))
    if suffix in table:
        return _identity(table[suffix])
    layouts = family.layer_layouts(prefix, hf_config)
    if suffix in layouts:
        return _Mapping(*layouts[suffix])
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return _qkv(prefix, suffix.rsplit(".", 1)[1], shapes, family.attention_output_gate)
    if suffix == "mlp.linear_fc1.weight":
        gate_up = _gate_up(prefix, tp, family.dense_mlp_block)
        return gate_up if family.fused_gate_up is None else _row_fused(family.fused_gate_up(prefix), gate_up)
    raise KeyError(f"no HF mapping for layer parameter {suffix!r}")


def unwrap_model(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):  # DDP / Float16Module wrappers
        chunk = chunk.module
    return chunk


# the routers' buffers a checkpoint holds: the expert bias (megatron updates it outside the optimizer) and
# DeepSeek-V4's frozen token -> experts table of its hash layers
_ROUTER_BUFFERS = ("mlp.router.expert_bias", "mlp.router.tid2eid")


def _weights(model: torch.nn.Module, mtp: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """What maps to HF tensors: every parameter but LoRA factors (merged into their layer's weight at export),
    then the routers' buffers (_ROUTER_BUFFERS, in module order); the MTP layers' only with `mtp`."""
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        is_weight = ((isinstance(tensor, torch.nn.Parameter) and not lora.is_adapter_param(name))
                     or (name.endswith(_ROUTER_BUFFERS) and tensor is not None))
        if is_weight and (mtp or not name.startswith("mtp.")):
            yield name, tensor


def exported_tensors(model: torch.nn.Module, mtp: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(megatron name, local tensor) of everything the export reads: parameters and the routers' expert biases."""
    return _weights(model, mtp)


def _has_mtp(model: torch.nn.Module) -> bool:
    return getattr(model, "mtp", None) is not None


def _text_prefix(hf_config: Any) -> str:
    """Where the text model's weights sit: `model.`, or a composite checkpoint's `model.language_model.`."""
    return getattr(hf_config, TEXT_PREFIX_ATTRIBUTE, "model.")


def _vision_prefix(hf_config: Any) -> str | None:
    """Where the built vision tower's tensors sit in the checkpoint; None when the trainer builds none."""
    vision = getattr(hf_config, VISION_ATTRIBUTE, None)
    return vision.hf_prefix if vision is not None else None


def _tied(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))


@dataclass(frozen=True)
class _ExpertLayout:
    """Sizes and this rank's coordinates in the expert-parallel (EP) and expert-TP (ETP) groups."""

    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0
    ep_group: Any = None
    etp_group: Any = None


def _expert_layout() -> _ExpertLayout:
    from megatron.core import parallel_state as mpu

    try:
        return _ExpertLayout(mpu.get_expert_model_parallel_world_size(), mpu.get_expert_model_parallel_rank(),
                             mpu.get_expert_tensor_parallel_world_size(), mpu.get_expert_tensor_parallel_rank(),
                             mpu.get_expert_model_parallel_group(), mpu.get_expert_tensor_parallel_group())
    except (AssertionError, RuntimeError):  # expert groups not initialised: a dense model
        return _ExpertLayout()


def _layer_suffix(name: str) -> str:
    match = _LAYER_NAME.match(name) or _MTP_LAYER_NAME.match(name)
    return match.group(2) if match else ""


def _layer_and_prefix(model: torch.nn.Module, name: str, hf_config: Any) -> tuple[torch.nn.Module, str, str]:
    """(the transformer layer holding parameter `name`, its suffix there, the layer's HF prefix)."""
    match = _LAYER_NAME.match(name)
    if match is not None:
        layer = model.decoder.layers[int(match.group(1))]
        return layer, match.group(2), f"{_text_prefix(hf_config)}layers.{layer.layer_number - 1}."
    match = _MTP_LAYER_NAME.match(name)
    index = int(match.group(1))
    names = family_of(hf_config).mtp_names(hf_config, index)
    return model.mtp.layers[index].transformer_layer, match.group(2), names.layer_prefix


def _mtp_part(name: str, hf_config: Any) -> _Mapping:
    """An MTP layer's own norm or projection (not its transformer layer)."""
    match = _MTP_PART_NAME.match(name)
    names = family_of(hf_config).mtp_names(hf_config, int(match.group(1)))
    hf_name = names.parts.get(match.group(2))
    if hf_name is None:
        raise KeyError(f"no HF mapping for MTP parameter {name!r}")
    if match.group(2) != "eh_proj.weight" or not names.hidden_first:
        return _identity(hf_name)
    # HF projects [hidden; embedding], megatron [embedding; hidden]: the column halves swap
    swap = lambda t: torch.cat(t.chunk(2, dim=1)[::-1], dim=1)  # noqa: E731
    return _Mapping((hf_name,), lambda ts: swap(ts[0]), lambda t: [swap(t)])


def _with_copies(mapping: _Mapping, copies: tuple[str, ...]) -> _Mapping:
    """`mapping` also written to `copies` (DeepSeek-V3's MTP layer keeps its own embedding and output layer, equal
    to the shared ones); the load reads the first name only."""
    if not copies:
        return mapping
    n = len(mapping.hf_names)
    return _Mapping((*mapping.hf_names, *copies), lambda ts: mapping.to_megatron(ts[:n]),
                    lambda t: (lambda hf: hf + [hf[0].clone() for _ in copies])(mapping.to_hf(t)))


def _mtp_copies(model: torch.nn.Module, hf_config: Any, attribute: str, mtp: bool) -> tuple[str, ...]:
    if not (mtp and _has_mtp(model)):
        return ()
    names = [getattr(family_of(hf_config).mtp_names(hf_config, k), attribute) for k in range(len(model.mtp.layers))]
    return tuple(n for n in names if n)


def _is_embedding_copy(model: torch.nn.Module, name: str) -> bool:
    """The last pipeline stage's copy of the word embedding, which its MTP layers embed with (megatron keeps it equal
    to the first stage's by all-reducing their grads over the embedding group): loaded from embed_tokens, but the
    HF checkpoint holds one embed_tokens, exported from the first stage; this copy writes only the MTP layers' own
    copies of it (DeepSeek-V3's), if any."""
    return name == "embedding.word_embeddings.weight" and not getattr(model, "pre_process", True)


def _exported(model: torch.nn.Module, name: str, mapping: _Mapping, full: torch.Tensor
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf name, tensor) pairs of one mapped parameter, as the export writes them."""
    pairs = zip(mapping.hf_names, mapping.to_hf(full))
    if _is_embedding_copy(model, name):
        next(pairs)
    return pairs


def _is_expert(name: str) -> bool:
    return moe_hf.is_expert_param(_layer_suffix(name))


def _split_size(name: str, tp: int, experts: _ExpertLayout) -> int:
    """How many ranks split this parameter: ETP for routed experts, TP otherwise."""
    return experts.etp if _is_expert(name) else tp


def _mapping_for(model: torch.nn.Module, name: str, param: torch.Tensor, hf_config: Any,
                 tp: int, ep_rank: int | None = None, mtp: bool = True) -> _Mapping | None:
    """The mapping of one megatron parameter, or None if it has no HF counterpart of its own.

    Routed experts: the HF expert is that of EP rank `ep_rank` (default: this rank) and local index i.
    `mtp`: the embedding and output layer are also written to the MTP layers' copies of them, if any."""
    if _is_expert(name):
        return _expert_mapping(model, name, hf_config, ep_rank)
    shapes, text = _shapes(hf_config), _text_prefix(hf_config)
    named = family_of(hf_config).model_names(text)
    padded_rows = param.shape[0] * (tp if getattr(param, "tensor_model_parallel", False) else 1)
    if name == "embedding.word_embeddings.weight":
        return _with_copies(_vocab(f"{text}embed_tokens.weight", shapes, padded_rows),
                            _mtp_copies(model, hf_config, "embedding_copy", mtp))
    if name == "output_layer.weight":
        output = f"{text}embed_tokens.weight" if _tied(hf_config) else named.get(name, "lm_head.weight")
        return _with_copies(_vocab(output, shapes, padded_rows), _mtp_copies(model, hf_config, "output_copy", mtp))
    if name in named:
        return _identity(named[name])
    if name == "decoder.final_layernorm.weight":
        return _identity(f"{text}norm.weight")
    if name.startswith(f"{VISION_MODULE}.") and _vision_prefix(hf_config):  # transformers' own tower: its names
        return _identity(_vision_prefix(hf_config) + name[len(VISION_MODULE) + 1:])
    if _LAYER_NAME.match(name) is None and _MTP_LAYER_NAME.match(name) is None:
        if _MTP_PART_NAME.match(name) is not None:
            return _mtp_part(name, hf_config)
        raise KeyError(f"no HF mapping for parameter {name!r}")
    _, suffix, prefix = _layer_and_prefix(model, name, hf_config)
    return _layer_mapping(suffix, prefix, shapes, tp, hf_config)


def _expert_mapping(model: torch.nn.Module, name: str, hf_config: Any, ep_rank: int | None) -> _Mapping:
    layer, suffix, prefix = _layer_and_prefix(model, name, hf_config)
    experts = _expert_layout()
    local_index, _ = moe_hf.local_expert(suffix)
    rank = experts.ep_rank if ep_rank is None else ep_rank
    global_expert = rank * layer.mlp.experts.num_local_experts + local_index
    return _layer_mapping(suffix, prefix, _shapes(hf_config), experts.etp, hf_config, global_expert)


def _tp() -> tuple[int, int, Any]:
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_group())


class HFCheckpointError(ValueError):
    """The HF checkpoint's tensors do not match its config (missing, mis-shaped or unreadable files)."""


class _SafetensorsReader:
    """Reads named tensors from an HF checkpoint dir (single file or index-sharded); with the config of an MXFP4
    checkpoint, as its bf16 checkpoint (mxfp4.DequantisedView)."""

    def __init__(self, hf_dir: str, hf_config: Any = None):
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
        quantized = hf_config is not None and mxfp4.is_mxfp4(getattr(hf_config, "quantization_config", None))
        self._view = mxfp4.DequantisedView(list(weight_map), self._file_shape, self._file_get) if quantized else None

    def names(self) -> list[str]:
        return self._view.names() if self._view else list(self._weight_map)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The tensor's shape from the file header (no data read); None when the checkpoint lacks it."""
        return self._view.shape(name) if self._view else self._file_shape(name)

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor, or its entry `index` of the first dimension (only that part is read)."""
        return self._view.read(name, index) if self._view else self._file_get(name, index)

    def _file_shape(self, name: str) -> tuple[int, ...] | None:
        if name not in self._weight_map:
            return None
        with safe_open(os.path.join(self._dir, self._weight_map[name]), framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def _file_get(self, name: str, index: int | None = None) -> torch.Tensor:
        if name not in self._weight_map:
            raise KeyError(f"{name} not found in {self._dir}")
        with safe_open(os.path.join(self._dir, self._weight_map[name]), framework="pt") as f:
            return f.get_tensor(name) if index is None else f.get_slice(name)[index]


def full_shape(name: str, param: torch.Tensor, tp: int) -> tuple[int, ...]:
    """The parameter's shape once gathered over the ranks that split it (TP, or ETP for routed experts)."""
    shape = list(param.shape)
    split = _split_size(name, tp, _expert_layout())
    if split > 1 and getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= split
    return tuple(shape)


def _ep_ranks(name: str, all_experts: bool) -> list[int | None]:
    """The EP ranks whose copy of a parameter the export yields: all of them for a routed expert."""
    return list(range(_expert_layout().ep)) if all_experts and _is_expert(name) else [None]


def hf_tensor_shapes(model: torch.nn.Module, hf_config: Any, tp: int, *, all_experts: bool, mtp: bool = True,
                     select: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf name, meta tensor of its full shape and dtype) of every HF tensor of this chunk, no data.

    all_experts: as export_hf_weights yields them (every EP rank's experts, in its order); otherwise only
    what this rank loads (its own experts). Tied output weights and the last stage's embedding copy are
    skipped in export order, as there; `mtp` and `select` as there. A stacked experts' tensor comes once, with
    its whole shape: where the export yields it (all_experts), else at this rank's first expert."""
    stacked_seen: set[str] = set()
    for name, param in _weights(model, mtp):
        if all_experts and name == "output_layer.weight" and _tied(hf_config):
            continue
        if select is not None and not select(name):
            continue
        full = torch.empty(full_shape(name, param, tp), dtype=param.dtype, device="meta")
        for ep_rank in _ep_ranks(name, all_experts):
            mapping = _mapping_for(model, name, param, hf_config, tp, ep_rank, mtp)
            if mapping.stacked is not None:
                (hf_name,) = mapping.hf_names
                if (mapping.last_row if all_experts else hf_name not in stacked_seen):
                    yield hf_name, _stacked_meta(mapping.to_hf(full)[0], mapping.stacked[1])
                stacked_seen.add(hf_name)
            elif all_experts:
                yield from _exported(model, name, mapping, full)
            else:
                yield from zip(mapping.hf_names, mapping.to_hf(full))


def _stacked_meta(row: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.empty((rows, *row.shape), dtype=row.dtype, device="meta")


def _expected_hf_shapes(model: torch.nn.Module, hf_config: Any, tp: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(hf name, full shape) of every HF tensor this model chunk loads, from meta tensors (no data)."""
    return ((n, tuple(t.shape)) for n, t in hf_tensor_shapes(model, hf_config, tp, all_experts=False))


def check_hf_tensors(model_chunks: list[torch.nn.Module], reader: _SafetensorsReader, hf_config: Any, tp: int) -> None:
    """Raise HFCheckpointError listing every missing or mis-shaped tensor, before anything is loaded."""
    missing, misshaped, main = [], [], set()
    for chunk in model_chunks:
        main.update(n for n, _ in hf_tensor_shapes(unwrap_model(chunk), hf_config, tp, all_experts=False, mtp=False))
        for name, expected in _expected_hf_shapes(unwrap_model(chunk), hf_config, tp):
            found = reader.shape(name)
            if found is None:
                missing.append(name)
            elif found != expected:
                misshaped.append(f"{name}: file {found}, config expects {expected}")
    if not missing and not misshaped:
        return
    if missing and not misshaped and not main.intersection(missing):
        raise HFCheckpointError(
            f"--hf-checkpoint {reader._dir} holds no weights for its multi-token-prediction layers ({len(missing)} "
            f"missing: {missing[:3]} ...; transformers' own classes drop them when saving): drop --mtp-num-layers "
            "and --enable-mtp-training, or use the released checkpoint that carries them")
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
    experts = _expert_layout()
    reader = _SafetensorsReader(hf_dir, hf_config)
    untrained = untrained_tensor_names(reader.names(), hf_config)
    if untrained:
        logger.info("--hf-checkpoint %s: %d tensors outside the model the trainer builds (%s ...) are not built, "
                    "and --save-hf carries them through unchanged", hf_dir, len(untrained), untrained[0])
    check_moe_checkpoint(reader, hf_config)
    check_hf_tensors(model_chunks, reader, hf_config, tp)
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        for name, param in _weights(model):
            mapping = _mapping_for(model, name, param, hf_config, tp)
            full = mapping.to_megatron([reader.get(n, mapping.row) for n in mapping.hf_names])
            if getattr(param, "tensor_model_parallel", False):
                split, rank = (experts.etp, experts.etp_rank) if _is_expert(name) else (tp, tp_rank)
                full = full.chunk(split, dim=param.partition_dim)[rank]
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
                      read_param: Callable[[torch.Tensor], torch.Tensor] | None = None, mtp: bool = True,
                      select: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for this PP stage's parameters, in a fixed order.

    Order: model chunks in order, then each chunk's named_parameters() order (identical on all
    ranks of a stage); layer names use GLOBAL layer indices. Every rank of a TP group must
    iterate it to the end together (one all_gather over the TP group per TP-split parameter);
    ranks of different DP/CP replicas or PP stages are independent. With tied embeddings the
    last stage's output_layer copy is skipped (HF ties lm_head to embed_tokens), and so is the MTP stage's copy of
    the embedding (`_is_embedding_copy`). `read_param` gives
    a parameter's value (default: the live tensor; a sleeping trainer serves its host copy). `mtp=False` leaves
    the multi-token-prediction layers (and their copies of the embedding and output layer) out. A layer with a
    LoRA adapter yields its merged weight W + alpha/r * B @ A. `select` (megatron name -> bool) keeps a subset,
    the same on every rank.
    """
    read = read_param or (lambda param: param.detach())
    tp, _, tp_group = _tp()
    experts = _expert_layout()
    stacks: dict[str, dict[int, torch.Tensor]] = {}  # stacked experts' rows gathered so far
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        for name, param in _weights(model, mtp):
            if name == "output_layer.weight" and _tied(hf_config):
                continue
            if select is not None and not select(name):
                continue
            if _is_expert(name):
                yield from _export_expert(model, name, param, _merged(model, name, read(param), read), hf_config,
                                          experts, stacks)
                continue
            mapping = _mapping_for(model, name, param, hf_config, tp, mtp=mtp)
            if _is_embedding_copy(model, name) and len(mapping.hf_names) == 1:
                continue  # the first stage exports embed_tokens (the same on every rank of this TP group)
            full = _merged(model, name, read(param), read)
            if tp > 1 and getattr(param, "tensor_model_parallel", False):
                full = _gather_tp(full, param.partition_dim, tp, tp_group)
            yield from _exported(model, name, mapping, full)


def _merged(model: torch.nn.Module, name: str, value: torch.Tensor, read: Callable[[torch.Tensor], torch.Tensor]
            ) -> torch.Tensor:
    """This rank's shard of a weight with its LoRA update merged in (the value itself if it has no adapter)."""
    owner, _, leaf = name.rpartition(".")
    adapter = getattr(model.get_submodule(owner), lora.ADAPTER, None) if leaf == "weight" else None
    return value + adapter.delta(read) if isinstance(adapter, lora.LoraAdapter) else value


def _export_expert(model: torch.nn.Module, name: str, param: torch.Tensor, value: torch.Tensor, hf_config: Any,
                   experts: _ExpertLayout, stacks: dict[str, dict[int, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """One local expert parameter: gathered over ETP, then over EP (group: ep), yielded for every EP rank (a
    stacked experts' row kept in `stacks` until the last row comes)."""
    if experts.etp > 1 and getattr(param, "tensor_model_parallel", False):
        value = _gather_tp(value, param.partition_dim, experts.etp, experts.etp_group)
    copies = [value]
    if experts.ep > 1:
        copies = [torch.empty_like(value) for _ in range(experts.ep)]
        dist.all_gather(copies, value.contiguous(), group=experts.ep_group)
    for ep_rank, full in enumerate(copies):
        mapping = _mapping_for(model, name, param, hf_config, 0, ep_rank)
        if mapping.stacked is None:
            yield from zip(mapping.hf_names, mapping.to_hf(full))
            continue
        (hf_name,) = mapping.hf_names
        rows = stacks.setdefault(hf_name, {})
        rows[mapping.row] = mapping.to_hf(full)[0]
        if mapping.last_row:
            del stacks[hf_name]
            if len(rows) != mapping.stacked[1]:
                raise RuntimeError(f"{hf_name}: {len(rows)} of its {mapping.stacked[1]} experts were exported (a "
                                   "selection must take every expert of a layer or none)")
            yield hf_name, torch.stack([rows[row] for row in range(mapping.stacked[1])])


def untrained_tensor_names(names: list[str], hf_config: Any) -> list[str]:
    """A composite (vision + text) checkpoint's tensors outside what the trainer builds (its text model, and its
    vision tower when the run trains on images); none for a text checkpoint."""
    text = getattr(hf_config, TEXT_PREFIX_ATTRIBUTE, None)
    if text is None:
        return []
    built = (text, _vision_prefix(hf_config) or text)
    return sorted(n for n in names if not n.startswith(built) and n != "lm_head.weight")


def carried_tensors(hf_dir: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors --save-hf copies unchanged from --hf-checkpoint (a composite's vision tower), so the saved
    checkpoint is complete."""
    reader = _SafetensorsReader(hf_dir)
    for name in untrained_tensor_names(reader.names(), hf_config):
        yield name, reader.get(name)


def check_moe_checkpoint(reader: "_SafetensorsReader", hf_config: Any) -> None:
    """An MoE checkpoint must hold exactly the experts its config (and so --num-experts) says."""
    arch = family_of(hf_config).moe(hf_config)
    if arch is None:
        return
    found = moe_hf.checkpoint_expert_count(reader.names(), arch)
    if found is not None and found != arch.num_experts:
        raise HFCheckpointError(
            f"--hf-checkpoint {reader._dir} holds {found} experts per MoE layer, its config.json (and "
            f"--num-experts) says {arch.num_experts}; fix num_experts in config.json or use the matching checkpoint")


PEFT_PREFIX = "base_model.model."


@torch.no_grad()
def export_peft_adapter(model_chunks: list[torch.nn.Module], hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, full tensor) of every LoRA factor of this PP stage, as PEFT saves a LoRA adapter of the HF model:
    `base_model.model.<hf module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]. A fused layer (q/k/v,
    gate/up) gives each HF module the shared A and its rows of B (the weight's own mapping splits B).
    Every rank of a TP group iterates it together (split factors are gathered)."""
    tp, _, tp_group = _tp()
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        for layer_name, layer in lora.adapted_layers(model):
            if layer.lora.expert:
                raise ValueError(f"{layer_name}: a routed expert's adapter has no PEFT name (transformers fuses the "
                                 "experts into one parameter); export the merged weights instead")
            a, b = (_gather_tp(p.detach(), p.partition_dim, tp, tp_group)
                    if tp > 1 and getattr(p, "tensor_model_parallel", False) else p.detach()
                    for p in (layer.lora.lora_A, layer.lora.lora_B))
            mapping = _mapping_for(model, f"{layer_name}.weight", layer.weight, hf_config, tp)
            for hf_name, b_part in zip(mapping.hf_names, mapping.to_hf(b)):
                module = PEFT_PREFIX + hf_name.removesuffix(".weight")
                yield f"{module}.lora_A.weight", a
                yield f"{module}.lora_B.weight", b_part
