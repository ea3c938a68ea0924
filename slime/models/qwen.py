"""Qwen3 and Qwen2 dense (transformers' Qwen3ForCausalLM, Qwen2ForCausalLM): Llama layers with one change each.

- Qwen3: an RMSNorm on each head's q and k before RoPE (HF self_attn.q_norm / k_norm, megatron's
  q_layernorm / k_layernorm).
- Qwen2: biases on the q/k/v projections (not on o_proj), mapped like their weights.
Both may slide: layers whose `layer_types` entry is "sliding_attention" attend to the last `sliding_window` keys
(hf_arch.sliding_windows; the windowed core attention in cp_attention.py).
Their MoE siblings (qwen3_moe, qwen2_moe) are in qwen3_moe.py.
"""

from __future__ import annotations

from slime.models.hf_arch import sliding_windows
from slime.models.hf_fields import SLIDING_WINDOW, ignored, table
from slime.models.registry import DENSE_FIELDS, ModelFamily, register

QWEN3_FIELDS = table(DENSE_FIELDS, SLIDING_WINDOW)
QWEN2_FIELDS = table(QWEN3_FIELDS, attention_bias=ignored(
    "transformers' Qwen2 class reads none: q/k/v always have a bias, o_proj never (both built)"))

QWEN3 = register(ModelFamily(name="Qwen3", model_types=("qwen3",), qk_layernorm=True, hf_fields=QWEN3_FIELDS,
                             attention_windows=sliding_windows))
QWEN2 = register(ModelFamily(name="Qwen2", model_types=("qwen2",), qkv_bias=True, hf_fields=QWEN2_FIELDS,
                             attention_windows=sliding_windows))
