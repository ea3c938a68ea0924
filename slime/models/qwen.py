"""Qwen3 and Qwen2 dense (transformers' Qwen3ForCausalLM, Qwen2ForCausalLM): Llama layers with one change each.

- Qwen3: an RMSNorm on each head's q and k before RoPE (HF self_attn.q_norm / k_norm, megatron's
  q_layernorm / k_layernorm).
- Qwen2: biases on the q/k/v projections (not on o_proj), mapped like their weights.
Their MoE siblings (qwen3_moe, qwen2_moe) are in qwen3_moe.py.
"""

from __future__ import annotations

from slime.models.registry import ModelFamily, register

QWEN3 = register(ModelFamily(name="Qwen3", model_types=("qwen3",), qk_layernorm=True))
QWEN2 = register(ModelFamily(name="Qwen2", model_types=("qwen2",), qkv_bias=True))
