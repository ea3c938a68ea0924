"""The HF side of MoE layers that every MoE family shares: the HF <-> megatron names and layouts of the MoE
layer's parameters (Qwen-MoE's and DeepSeek-V3's spelling; a family spelling them otherwise gives its own
ModelFamily.moe_names), where transformers keeps the experts in memory, how many experts a checkpoint holds,
and the routes the engine took (routing replay).

HF checkpoint (safetensors, what the hub ships and what transformers saves):
  model.layers.L.mlp.gate.weight                      [E, H]   router
  model.layers.L.mlp.experts.e.{gate,up,down}_proj.weight       expert e (SwiGLU)
  model.layers.L.mlp.shared_expert.{gate,up,down}_proj.weight   shared expert (Qwen2-MoE)
  model.layers.L.mlp.shared_expert_gate.weight        [1, H]   sigmoid gate of the shared expert
  model.layers.L.mlp.shared_experts.{gate,up,down}_proj.weight  DeepSeek-V3's shared experts (no gate)
  model.layers.L.mlp.gate.e_score_correction_bias     [E]      DeepSeek-V3's and GLM's routing bias (fp32)
  MiniMax-M2: model.layers.L.block_sparse_moe.{gate.weight, e_score_correction_bias, experts.e.w{1,3,2}.weight}
  (MoEArchitecture.hf_block / hf_expert_bias / hf_expert_projs say which spelling a family has)
megatron-core (local spec, SequentialMLP):
  decoder.layers.l.mlp.router.weight, .expert_bias (a buffer)
  decoder.layers.l.mlp.experts.local_experts.i.linear_fc{1,2}.weight   (TE grouped: experts.linear_fc1.weight<i>)
  decoder.layers.l.mlp.shared_experts.linear_fc{1,2}.weight, .gate_weight
Expert i of EP rank r is global expert r * (E / EP) + i; expert weights are split over the expert-TP group
(fc1 as [gate_r; up_r] per ETP rank, like the dense MLP). transformers keeps the experts fused in memory
(mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]): `fused_engine_target` maps a
checkpoint name onto that storage for the embedded engine.
"""

from __future__ import annotations

import re

from slime.models.moe_arch import MoEArchitecture

_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(?:weight|bias)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(?:weight|bias)(\d+)$")


def is_expert_param(layer_suffix: str) -> bool:
    """Routed-expert parameters: sharded over EP x ETP, not over TP."""
    return layer_suffix.startswith("mlp.experts.")


def local_expert(layer_suffix: str) -> tuple[int, str] | None:
    """(local expert index, 'linear_fc1' | 'linear_fc2') of an expert parameter's layer suffix (a weight, or the
    bias of experts that have one: gpt-oss)."""
    match = _LOCAL_EXPERT.match(layer_suffix)
    if match:
        return int(match.group(1)), match.group(2)
    match = _GROUPED_EXPERT.match(layer_suffix)
    if match:
        return int(match.group(2)), match.group(1)
    return None


def swiglu_names(prefix: str) -> tuple[str, str, str]:
    """(gate, up, down) HF names of a SwiGLU MLP under prefix."""
    return tuple(f"{prefix}{p}_proj.weight" for p in ("gate", "up", "down"))


def moe_hf_names(layer_suffix: str, prefix: str, global_expert: int | None,
                 shared_expert: str = "shared_expert", arch: MoEArchitecture | None = None) -> tuple[str, ...] | None:
    """HF names of one MoE-layer parameter (prefix 'model.layers.L.'); None when it is not an MoE one.

    fc1 names come as (gate, up): the caller fuses them with the TP/ETP interleaving of the dense MLP.
    `shared_expert` is the HF module name of the shared expert (MoEArchitecture.hf_shared_expert); `arch`
    says how the checkpoint spells the block, the experts' projections and the routing bias (default: the
    Qwen-MoE / DeepSeek-V3 spelling). The router's expert bias (a buffer megatron updates outside the
    optimizer) is the checkpoint's e_score_correction_bias.
    """
    block = f"{prefix}{arch.hf_block if arch else 'mlp'}."
    if layer_suffix == "mlp.router.weight":
        return (f"{block}gate.weight",)
    if layer_suffix == "mlp.router.expert_bias":
        return (f"{block}{arch.hf_expert_bias if arch else 'gate.e_score_correction_bias'}",)
    if layer_suffix == "mlp.shared_experts.gate_weight":
        return (f"{block}shared_expert_gate.weight",)
    if layer_suffix.startswith("mlp.shared_experts."):
        gate, up, down = swiglu_names(f"{block}{shared_expert}.")
        return (gate, up) if layer_suffix.endswith("linear_fc1.weight") else (down,)
    expert = local_expert(layer_suffix)
    if expert is None or ".bias" in layer_suffix:  # experts with biases are stacked (ModelFamily.stacked_experts)
        return None
    projs = arch.hf_expert_projs if arch else ("gate_proj", "up_proj", "down_proj")
    gate, up, down = (f"{block}experts.{global_expert}.{p}.weight" for p in projs)
    return (gate, up) if expert[1] == "linear_fc1" else (down,)


def family_moe_names(layer_suffix: str, prefix: str, global_expert: int | None,
                     arch: MoEArchitecture | None) -> tuple[str, ...] | None:
    """ModelFamily.moe_names: the names moe_hf_names gives for the family's MoEArchitecture."""
    return moe_hf_names(layer_suffix, prefix, global_expert, arch.hf_shared_expert if arch else "shared_expert", arch)


_CHECKPOINT_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.weight$")


def _in_memory_name(name: str, arch: MoEArchitecture | None) -> str:
    """transformers' in-memory name of a checkpoint tensor outside the experts: its MoE block is `mlp`."""
    if arch is None or arch.hf_block == "mlp":
        return name
    return name.replace(f".{arch.hf_block}.", ".mlp.", 1)


def fused_engine_target(name: str, state_names: set[str], arch: MoEArchitecture | None
                        ) -> tuple[str, int | None, slice] | None:
    """Where a checkpoint tensor lives in transformers' in-memory model when not under its own name:
    (state name, expert index or None, row slice) -- a routed expert's rows of the fused experts, or a
    renamed block's tensor (expert index None) -- or None when the model keeps that name as is."""
    if name in state_names or arch is None:
        return None
    renamed = _in_memory_name(name, arch)
    if renamed in state_names:
        return renamed, None, slice(None)
    match = _CHECKPOINT_EXPERT.match(renamed)
    if match is None or match.group(3) not in arch.hf_expert_projs:
        return None
    base, expert, proj = match.group(1), int(match.group(2)), arch.hf_expert_projs.index(match.group(3))
    if proj == 2:
        return f"{base}.experts.down_proj", expert, slice(None)
    width = arch.ffn_hidden_size
    rows = slice(0, width) if proj == 0 else slice(width, 2 * width)
    return f"{base}.experts.gate_up_proj", expert, rows


def checkpoint_expert_count(names: list[str], arch: MoEArchitecture) -> int | None:
    """Experts per MoE layer that a checkpoint's tensor names hold (the first MoE layer's); None if none."""
    first = arch.layer_pattern.index(1) if 1 in arch.layer_pattern else None
    if first is None:
        return None
    pattern = re.compile(rf"^model\.layers\.{first}\.{re.escape(arch.hf_block)}\.experts\.(\d+)\.")
    indices = {int(m.group(1)) for m in map(pattern.match, names) if m}
    return (max(indices) + 1) if indices else None


# ------------------------------------------------------------------ routes the engine took (routing replay)


def router_modules(model) -> list:
    """transformers' MoE routers (model.layers.L.mlp.gate; gpt-oss's mlp.router) in layer order: what each MoE
    layer routed."""
    return [module for name, module in model.named_modules()
            if re.fullmatch(r".*layers\.\d+\.mlp\.(gate|router)", name)]


class RouteCapture:
    """Forward hooks on the routers of one generation batch: each forward's top-k expert ids, kept per row
    for the positions the row really fed (left padding dropped)."""

    def __init__(self, model):
        self._per_layer: list = []
        self._hooks = [m.register_forward_hook(self._hook) for m in router_modules(model)]

    def _hook(self, module, inputs, output):
        self._per_layer.append(output[2])  # (router logits, top-k weights, top-k expert ids)

    def take(self, rows: list, shape, mask) -> None:
        import torch

        batch, width = shape
        ids = torch.stack(self._per_layer, dim=1).reshape(batch, width, len(self._per_layer), -1)  # [B, S, L, k]
        self._per_layer = []
        for b, row in enumerate(rows):
            row.routes.append(ids[b][mask[b].bool()].to(torch.int32).cpu())

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def encode_routes(row) -> str:
    """SGLang's meta_info.routed_experts: base64 of int32 [tokens, MoE layers, top-k], one row per token that
    went through the model (the prompt and every output token but the last), from routed_experts_start_len."""
    import base64

    import torch

    fed = len(row.request.input_ids) + len(row.output_ids) - 1
    routes = torch.cat(row.routes)[:fed][row.request.routed_experts_start_len:]
    return base64.b64encode(routes.contiguous().numpy().tobytes()).decode()


def decode_routes(encoded: str, num_layers: int, topk: int):
    """The inverse of encode_routes: an int32 numpy array [tokens, num_layers, topk]."""
    import base64

    import numpy as np

    return np.frombuffer(base64.b64decode(encoded), dtype=np.int32).reshape(-1, num_layers, topk)
