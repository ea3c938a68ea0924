"""LoRA adapters on megatron-core's tensor-parallel linear layers.

An adapter adds ``alpha/r * B @ A`` to a frozen linear layer's weight. It is a child module (``<layer>.lora``)
whose output a forward hook adds to the layer's, so the layer keeps its parameter names (load, the HF mapping
and the weight push read them unchanged). Under TP the adapter is sharded like its layer:

- column-parallel (output split): A [r, in] replicated, B [out/tp, r] split on the output. The rank-r
  activation is gathered over the sequence (SP) or copied into the TP region (no SP), as the layer's input is.
- row-parallel (input split): A [r, in/tp] split on the input, B [out, r] replicated. The partial rank-r
  activation is reduced as the layer's output is (all-reduce, or reduce-scatter over the sequence with SP).

A replicated factor that sees a sequence shard (column A, row B under SP) is marked ``sequence_parallel`` so
that finalize_model_grads all-reduces its gradient over TP, like a norm's. CP splits tokens only: nothing to do.

A routed expert's layer (``local_experts.{i}.linear_fc1/fc2``) gets its own adapter, local to its rank: the
dispatcher has already brought the expert its tokens, so the adapter adds no collective. Its factors are expert
parameters (``allreduce=False`` under EP, like the expert's weight: reduced over the expert-data-parallel group).
Experts split over tensor-parallel ranks (--expert-tensor-parallel-size > 1) would need a gradient reduction of
the replicated factor that the expert path does not have: refused.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

ADAPTER = "lora"
"""Child-module name of an adapter: its parameters are ``<layer>.lora.lora_A`` / ``<layer>.lora.lora_B``."""


@dataclass(frozen=True)
class LoraConfig:
    targets: tuple[str, ...]
    rank: int
    alpha: float
    dropout: float = 0.0
    seed: int = 1234

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def is_adapter_param(name: str) -> bool:
    return f".{ADAPTER}." in f".{name}"


class LoraAdapter(torch.nn.Module):
    """The factors of one layer's adapter, sharded as the layer (module docstring)."""

    def __init__(self, layer: torch.nn.Module, config: LoraConfig, name: str):
        super().__init__()
        self.column = isinstance(layer, ColumnParallelLinear)
        self.expert = bool(getattr(layer, "is_expert", False))
        self.scale, self.dropout = config.scale, config.dropout
        self.sequence_parallel = bool(layer.sequence_parallel) and not self.expert
        tp, rank_in_tp = _tp_of(layer)
        if self.expert and tp > 1:
            raise ValueError(f"LoRA on the routed expert layer {name} needs --expert-tensor-parallel-size 1 (it is "
                             f"{tp}): an expert's adapter is local to its rank")
        out_local, in_local = layer.weight.shape
        out_full, in_full = (out_local * tp, in_local) if self.column else (out_local, in_local * tp)
        dtype = layer.weight.dtype
        full_a = _init_a(config, name, in_full)
        a = full_a if self.column else full_a.chunk(tp, dim=1)[rank_in_tp]
        b_rows = out_local if self.column else out_full
        self.lora_A = torch.nn.Parameter(a.to(device=layer.weight.device, dtype=dtype).contiguous())
        self.lora_B = torch.nn.Parameter(torch.zeros(b_rows, config.rank, device=layer.weight.device, dtype=dtype))
        split, replicated = (self.lora_B, self.lora_A) if self.column else (self.lora_A, self.lora_B)
        tensor_parallel.set_tensor_model_parallel_attributes(split, True, 0 if self.column else 1, 1)
        if self.expert:  # whole on its rank, like the expert's weight (never a TP duplicate in the grad norm)
            tensor_parallel.set_tensor_model_parallel_attributes(replicated, True, 0 if self.column else 1, 1)
        if self.sequence_parallel:
            replicated.sequence_parallel = True
        for param in (self.lora_A, self.lora_B):  # expert-parallel factors stay out of the dense DP reduction
            param.allreduce = getattr(layer.weight, "allreduce", True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout:
            x = F.dropout(x, self.dropout)
        h = F.linear(x, self.lora_A)
        if not self.expert:  # an expert's rank already holds its tokens (the dispatcher's work): no communication
            h = self._as_the_layer_does(h)
        return F.linear(h, self.lora_B) * self.scale

    def _as_the_layer_does(self, h: torch.Tensor) -> torch.Tensor:
        """The rank-r activation gathered (column) or reduced (row) over TP as the layer's input/output is."""
        if self.column:
            return (tensor_parallel.gather_from_sequence_parallel_region(h) if self.sequence_parallel
                    else tensor_parallel.copy_to_tensor_model_parallel_region(h))
        return (tensor_parallel.reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel
                else tensor_parallel.reduce_from_tensor_model_parallel_region(h))

    @torch.no_grad()
    def delta(self, read: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """alpha/r * B @ A as this rank's shard of the layer's weight (same shape as the local weight)."""
        b, a = read(self.lora_B), read(self.lora_A)
        return (b.float() @ a.float() * self.scale).to(b.dtype)


def _tp_of(layer: torch.nn.Module) -> tuple[int, int]:
    """(size, rank) of the layer's own tensor-parallel group: the expert-TP group for a routed expert."""
    group = getattr(layer, "tp_group", None)
    if group is None:
        return (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_tensor_model_parallel_rank())
    return group.size(), group.rank()


def _init_a(config: LoraConfig, name: str, in_full: int) -> torch.Tensor:
    """Kaiming-uniform A (B is zero, so the adapted model starts as the base), drawn whole from a generator of
    the layer's name: every TP rank draws the same full A and keeps its shard, so TP1 and TPn start equal."""
    generator = torch.Generator().manual_seed(config.seed + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(in_full)  # kaiming_uniform_(a=sqrt(5)) on a [r, in] weight
    return (torch.rand(config.rank, in_full, generator=generator) * 2 - 1) * bound


def _add_adapter_output(layer: torch.nn.Module, args: tuple, output):
    out, bias = output
    return out + layer.lora(args[0]), bias


def adapted_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    for name, module in model.named_modules():
        if isinstance(getattr(module, ADAPTER, None), LoraAdapter):
            yield name, module


def expert_adapter(layer: torch.nn.Module) -> "LoraAdapter | None":
    """A routed expert layer's adapter (the grouped expert path adds it itself), else None."""
    adapter = getattr(layer, ADAPTER, None)
    return adapter if isinstance(adapter, LoraAdapter) and adapter.expert else None


def has_expert_adapters(chunks) -> bool:
    return any(layer.lora.expert for chunk in chunks for _, layer in adapted_layers(_unwrapped(chunk)))


def adapted_weight_names(chunks) -> Callable[[str], bool]:
    """`name in ...` of the weights that training changes (megatron names of each chunk, unwrapped): those with an
    adapter, the base parameters trained in full and every exported buffer (a sigmoid router's expert bias, which
    megatron moves every step outside the optimizer); what a push after the first sends."""
    from slime.models.hf_weights import exported_tensors  # it maps the adapters' layers: imports this module

    names = set()
    for chunk in map(_unwrapped, chunks):
        names.update(f"{name}.weight" for name, _ in adapted_layers(chunk))
        names.update(name for name, p in chunk.named_parameters() if p.requires_grad and not is_adapter_param(name))
        names.update(name for name, t in exported_tensors(chunk) if not isinstance(t, torch.nn.Parameter))
    return frozenset(names).__contains__


def peft_unexportable(chunks) -> str | None:
    """Why the adapters cannot be written as a PEFT LoRA adapter (None when they can)."""
    base_trained = sorted(name for chunk in chunks for name, p in _unwrapped(chunk).named_parameters()
                          if p.requires_grad and not is_adapter_param(name))
    if base_trained:
        return f"base parameters trained in full beside the adapters ({', '.join(base_trained[:3])} ...)"
    if has_expert_adapters(chunks):
        return ("adapters on routed experts, which transformers fuses into one parameter per projection (no PEFT "
                "module name per expert)")
    return None


def _unwrapped(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):  # DDP / Float16Module wrappers
        chunk = chunk.module
    return chunk


def _targets(model: torch.nn.Module, config: LoraConfig) -> list[tuple[str, torch.nn.Module]]:
    found = [(name, module) for name, module in model.named_modules()
             if name.rsplit(".", 1)[-1] in config.targets and isinstance(module, (ColumnParallelLinear, RowParallelLinear))]
    missing = set(config.targets) - {name.rsplit(".", 1)[-1] for name, _ in found}
    if missing:
        raise ValueError(f"--lora-target-modules {' '.join(sorted(missing))} names no tensor-parallel linear layer "
                         "of this model")
    return found


_LOCAL_EXPERT = ".local_experts."


def _global_name(model: torch.nn.Module, name: str) -> str:
    """The layer's name with a routed expert's local index made global (EP rank * local experts + i): A is drawn
    from it, so an expert starts with the same adapter whatever the EP size."""
    if _LOCAL_EXPERT not in name:
        return name
    prefix, rest = name.split(_LOCAL_EXPERT, 1)
    local, tail = rest.split(".", 1)
    experts = model.get_submodule(prefix)
    ep_group = getattr(experts, "ep_group", None)
    ep_rank = ep_group.rank() if ep_group is not None else parallel_state.get_expert_model_parallel_rank()
    return f"{prefix}.experts.{ep_rank * experts.num_local_experts + int(local)}.{tail}"


def apply_lora(model: torch.nn.Module, config: LoraConfig, train_in_full: list[str] | None = None) -> int:
    """Freeze every parameter of `model` but those a `train_in_full` pattern matches (re.search: PEFT's
    modules_to_save, e.g. the output layer; None: none), attach an adapter to each target layer; returns how many."""
    patterns = train_in_full if train_in_full is not None else []
    for name, param in model.named_parameters():
        param.requires_grad_(any(re.search(pattern, name) for pattern in patterns))
    targets = _targets(model, config)
    for name, layer in targets:
        layer.add_module(ADAPTER, LoraAdapter(layer, config, _global_name(model, name)))
        layer.register_forward_hook(_add_adapter_output)
        _shard_adapter_in_checkpoint(layer)
    return len(targets)


def _shard_adapter_in_checkpoint(layer: torch.nn.Module) -> None:
    """The layer's own sharded_state_dict takes unknown keys for replicated: give the split factor its TP axis."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    base = layer.sharded_state_dict
    split_key = "lora.lora_B" if layer.lora.column else "lora.lora_A"
    axis = 0 if layer.lora.column else 1

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        result = base(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
        split = {split_key: getattr(layer.lora, split_key.split(".")[1])}
        result.update(make_sharded_tensors_for_checkpoint(
            split, prefix, {split_key: axis}, sharded_offsets, tp_group=getattr(layer, "tp_group", None),
            dp_cp_group=(metadata or {}).get("dp_cp_group")))
        return result

    layer.sharded_state_dict = sharded_state_dict
