"""What an HF MoE config says about its experts and router, in one frozen description that every MoE family
(qwen3_moe.py, deepseek_v3.py, glm4_moe.py, minimax_m2.py) fills and the megatron side
(slime/backends/megatron_utils/moe.py) reads; the hf_* fields say how the checkpoint spells the MoE block."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class MoEArchitecture:
    num_layers: int
    num_experts: int
    topk: int
    ffn_hidden_size: int
    """Width of each routed expert."""
    norm_topk_prob: bool
    """The top-k weights are renormalised to sum to one."""
    layer_pattern: tuple[int, ...]
    """Per layer: 1 = MoE layer, 0 = dense MLP."""
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    """A sigmoid gate scales the shared expert's output (Qwen2-MoE; DeepSeek has none)."""
    hf_shared_expert: str = "shared_expert"
    """The HF module name of the shared expert under `mlp.` (Qwen2-MoE: shared_expert, DeepSeek: shared_experts)."""
    hf_block: str = "mlp"
    """The checkpoint's module name of the MoE block in a layer (MiniMax-M2: block_sparse_moe)."""
    hf_expert_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """The checkpoint's (gate, up, down) names of a routed expert's projections (MiniMax-M2: w1, w3, w2)."""
    hf_expert_bias: str = "gate.e_score_correction_bias"
    """Where the routing bias sits under the MoE block (DeepSeek-V3, GLM: on the gate; MiniMax-M2: on the block)."""
    score_function: str = "softmax"
    """Router scores: softmax (Qwen) or sigmoid (DeepSeek-V3)."""
    expert_bias: bool = False
    """A per-expert bias added to the scores for the top-k choice only (DeepSeek-V3's e_score_correction_bias)."""
    topk_scaling_factor: float = 1.0
    """Factor on the top-k weights (DeepSeek-V3's routed_scaling_factor)."""
    num_groups: int = 1
    """Expert groups of group-limited routing (n_group); 1 = no grouping."""
    group_topk: int = 1
    """Groups each token may use (topk_group)."""

    @property
    def grouped(self) -> bool:
        """Group-limited routing that can exclude experts (some group is left out)."""
        return self.num_groups > 1 and self.group_topk < self.num_groups
