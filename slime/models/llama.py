"""Llama (transformers' LlamaForCausalLM, dense): the plain family every other one differs from.

Pre-norm decoder layers with grouped-query attention (no biases, no q/k norms), a SwiGLU MLP and RMSNorm;
RoPE default or llama3-scaled (its factor built, its other factors checked against megatron-core's). The builder's
generic fields, the generic field table (registry.DENSE_FIELDS) and hf_weights.py's dense name table are exactly
this model, so the family sets nothing of its own.
"""

from __future__ import annotations

from slime.models.registry import ModelFamily, register

LLAMA = register(ModelFamily(name="Llama", model_types=("llama",)))
