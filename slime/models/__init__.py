"""The models room: one module per HF model family, found through one registry keyed by config.json's
`model_type`, and the pieces the families share (CP attention, SP norm, fused kernels, the local layer spec,
the HF <-> megatron weight mapping). The megatron backend asks this package; slime_plugins/models keeps
upstream's import paths as aliases of these modules.

Families: llama.py (llama), qwen.py (qwen3, qwen2), qwen3_moe.py (qwen3_moe, qwen2_moe), deepseek_v3.py
(deepseek_v3, deepseek_v2, kimi_k2), glm4.py (glm4). Shared: registry.py (ModelFamily and the look-up),
hf_weights.py (weight mapping, load, export), moe_hf.py (MoE names, expert storage, routes), moe_arch.py
(MoEArchitecture), local_spec.py, cp_attention.py, sp_norm.py, fused_kernels.py. Importing this package loads neither torch nor megatron.
"""

from slime.models.registry import ModelFamily, family, family_of, register, supported_model_types

__all__ = ["ModelFamily", "family", "family_of", "register", "supported_model_types"]
