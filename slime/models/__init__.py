"""The models room: one module per HF model family, found through one registry keyed by config.json's
`model_type`, and the pieces the families share (CP attention, SP norm, fused kernels, the local layer spec,
the HF <-> megatron weight mapping). The megatron backend asks this package; slime_plugins/models keeps
upstream's import paths as aliases of these modules.

Families (registry._BUILTIN_MODULES): llama.py, qwen.py (qwen3, qwen2), qwen3_moe.py (qwen3_moe, qwen2_moe),
deepseek_v3.py (deepseek_v3, deepseek_v2, kimi_k2), glm4.py, qwen3_5.py (Qwen3.5 and Qwen3-Next), glm4_moe.py
(GLM-4.5, GLM-4.7-Flash), minimax_m2.py, glm_moe_dsa.py (GLM-5), mimo.py, deepseek_v4.py (its layers:
compressed_attention.py, hyper_connections.py, deepseek_v4_routers.py). Shared: registry.py (ModelFamily and the
look-up), hf_fields.py (every config field declared), hf_arch.py (the record the builder and the pre-Ray check
read, and the flag map), hf_weights.py (weight mapping, load, export), moe_hf.py, moe_arch.py, sigmoid_router.py,
grouped_experts.py, gated_deltanet.py / gated_delta_rule.py, sparse_attention.py / indexer_loss.py, mtp.py /
mtp_model.py, lora.py, local_spec.py, cp_attention.py / prefix_attention.py, sp_norm.py, fused_kernels.py.
Importing this package loads neither torch nor megatron.
"""

from slime.models.registry import ModelFamily, family, family_of, register, supported_model_types

__all__ = ["ModelFamily", "family", "family_of", "register", "supported_model_types"]
