"""A tiny random-init HF Qwen3 checkpoint for tests (no package ships tiny Qwen3 weights)."""

from __future__ import annotations

import os


def tiny_qwen3_config(**overrides):
    from transformers import Qwen3Config

    fields = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
    )
    fields.update(overrides)
    return Qwen3Config(**fields)


def save_tiny_qwen3(path: str, seed: int = 0, **overrides) -> str:
    """Random-init a tiny Qwen3ForCausalLM (fp32) and save it as safetensors under path."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config(**overrides)).float()
    with torch.no_grad():  # non-trivial norms so a wrong norm mapping shows up
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def save_tiny_qwen3_moe(path: str, seed: int = 0, **overrides) -> str:
    """A tiny random-init Qwen3MoeForCausalLM (8 experts, top-2, renormalised) saved as safetensors."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        router_aux_loss_coef=0.0,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields)).float()
    with torch.no_grad():  # non-trivial norms and a spread router, so wrong mappings show up
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path
