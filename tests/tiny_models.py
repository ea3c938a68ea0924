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
    return _perturb_and_save(Qwen3ForCausalLM(tiny_qwen3_config(**overrides)).float(), path)


def _perturb_and_save(model, path: str, also: tuple[str, ...] = ()) -> str:
    """Non-trivial norms (and `also` parameters, by name suffix) so a wrong mapping shows up; then save."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or any(name.endswith(suffix) for suffix in also):
                param.add_(0.1 * torch.randn_like(param))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def tiny_deepseek_v3_config(**overrides):
    """A DeepSeek-V3-shaped config (multi-latent attention); dense MLPs unless first_k_dense_replace says less."""
    from transformers import DeepseekV3Config

    fields = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    fields.update(overrides)
    return DeepseekV3Config(**fields)


def save_tiny_deepseek_v3(path: str, seed: int = 0, **overrides) -> str:
    """Random-init a tiny DeepseekV3ForCausalLM (fp32, norms perturbed) and save it under path."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    return _perturb_and_save(DeepseekV3ForCausalLM(tiny_deepseek_v3_config(**overrides)).float(), path)


def save_tiny_deepseek_v3_moe(path: str, seed: int = 0, **overrides) -> str:
    """A tiny DeepSeek-V3 with MoE layers: 3 layers (the first dense), 8 routed experts in 2 groups (one group
    per token, top-2 in it), one shared expert, routed_scaling_factor 2.5; a spread router and a non-zero
    e_score_correction_bias, so a wrong router mapping shows up."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    fields = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                  n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(tiny_deepseek_v3_config(**fields)).float()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("mlp.gate.weight"):
                tensor.normal_(0.0, 0.5)
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(0.2 * torch.rand_like(tensor))
    return _perturb_and_save(model, path)


def replace_model(checkpoint, save) -> None:
    """Keep a tiny checkpoint's tokenizer and generation config, replace its model by `save(path, **ids)`'s."""
    import json

    generation = (checkpoint / "generation_config.json").read_text()
    config = json.loads((checkpoint / "config.json").read_text())
    ids = dict(vocab_size=config["vocab_size"], pad_token_id=config["pad_token_id"],
               bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"])
    save(str(checkpoint), **ids)
    (checkpoint / "generation_config.json").write_text(generation)


def save_tiny_glm4(path: str, seed: int = 0, **overrides) -> str:
    """Random-init a tiny Glm4ForCausalLM (post norms, q/k/v biases, half-rotary interleaved RoPE) under path."""
    import torch
    from transformers import Glm4Config, Glm4ForCausalLM

    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, attention_bias=True)
    fields.update(overrides)
    torch.manual_seed(seed)
    return _perturb_and_save(Glm4ForCausalLM(Glm4Config(**fields)).float(), path, also=("bias",))


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


def _hybrid_fields(**overrides) -> dict:
    """Sizes shared by the tiny Qwen3-Next / Qwen3.5 checkpoints: both layer kinds, 2 key heads serving 4 value
    heads in the DeltaNet layers, GQA 4/2 with partial RoPE in the full-attention ones."""
    fields = dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    fields.update(overrides)
    return fields


_MOE_FIELDS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                   router_aux_loss_coef=0.0)


def _save_hybrid(model, path: str) -> str:
    """Non-trivial norms, DeltaNet decays and a spread router, so a wrong mapping shows up; then save."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                param.add_(0.3 * torch.randn_like(param))
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    return _perturb_and_save(model, path)


def save_tiny_qwen3_5(path: str, seed: int = 0, **overrides) -> str:
    """A tiny random-init Qwen3_5ForCausalLM (model_type qwen3_5_text): DeltaNet and gated attention layers."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    return _save_hybrid(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_hybrid_fields(**overrides))).float(), path)


def save_tiny_qwen3_5_moe(path: str, seed: int = 0, **overrides) -> str:
    """A tiny Qwen3_5MoeForCausalLM (qwen3_5_moe_text): every MLP routed (4 experts, top-2) + a gated shared one."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    fields = _hybrid_fields(**{**_MOE_FIELDS, **overrides})
    fields.pop("intermediate_size")
    torch.manual_seed(seed)
    return _save_hybrid(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**fields)).float(), path)


def save_tiny_qwen3_next(path: str, seed: int = 0, **overrides) -> str:
    """A tiny Qwen3NextForCausalLM: fused DeltaNet projections, the first layer's MLP dense, the others MoE."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    fields = _hybrid_fields(**{**_MOE_FIELDS, "mlp_only_layers": [0], "norm_topk_prob": True, **overrides})
    torch.manual_seed(seed)
    return _save_hybrid(Qwen3NextForCausalLM(Qwen3NextConfig(**fields)).float(), path)


def save_tiny_qwen3_5_composite(path: str, seed: int = 0, moe: bool = False, **overrides) -> str:
    """A tiny Qwen3_5ForConditionalGeneration (model_type qwen3_5; Qwen3_5MoeForConditionalGeneration, qwen3_5_moe,
    with `moe`): the tiny Qwen3.5 text model (text_config, weights under model.language_model.) beside a one-block
    vision tower (model.visual.)."""
    import torch
    import transformers

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    text = _hybrid_fields(**({**_MOE_FIELDS, **overrides} if moe else overrides))
    if moe:
        text.pop("intermediate_size")
    kind = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{kind}Config")(text_config=text, vision_config=vision)
    torch.manual_seed(seed)
    return _save_hybrid(getattr(transformers, f"{kind}ForConditionalGeneration")(config).float(), path)


def _spread_router(model, seed: int):
    """A spread router and a non-zero routing bias, so a wrong router mapping shows up."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("mlp.gate.weight"):
                tensor.copy_(0.5 * torch.randn(tensor.shape, generator=generator))
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(0.2 * torch.rand(tensor.shape, generator=generator))
    return model


def save_tiny_glm4_moe(path: str, seed: int = 0, **overrides) -> str:
    """A tiny Glm4MoeForCausalLM (GLM-4.5): 3 layers (the first dense), q/k/v biases, q/k norms, half-rotary RoPE,
    8 routed experts in 2 groups (one per token, top-2 in it), one shared expert, routed_scaling_factor 2.5."""
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=True, use_qk_norm=True,
                  first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
                  topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, pad_token_id=0)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = _spread_router(Glm4MoeForCausalLM(Glm4MoeConfig(**fields)).float(), seed)
    return _perturb_and_save(model, path, also=("bias",))


def save_tiny_glm4_moe_lite(path: str, seed: int = 0, **overrides) -> str:
    """A tiny Glm4MoeLiteForCausalLM (GLM-4.7-Flash): multi-latent attention, 3 layers (the first dense), 8 routed
    experts top-2, one shared expert, routed_scaling_factor 1.8."""
    import torch
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                  routed_scaling_factor=1.8, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, pad_token_id=0)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = _spread_router(Glm4MoeLiteForCausalLM(Glm4MoeLiteConfig(**fields)).float(), seed)
    return _perturb_and_save(model, path)


def save_tiny_minimax_m2(path: str, seed: int = 0, **overrides) -> str:
    """A tiny MiniMaxM2ForCausalLM: 2 layers, GQA with whole-projection q/k norms, rotary_dim = head_dim / 2,
    8 experts top-2 behind the sigmoid router with a routing bias, no shared expert."""
    import torch
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rotary_dim=8, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = MiniMaxM2ForCausalLM(MiniMaxM2Config(**fields)).float()
    with torch.no_grad():  # the bias is a buffer on the block, not on the gate
        generator = torch.Generator().manual_seed(seed)
        for name, tensor in model.state_dict().items():
            if name.endswith("mlp.gate.weight"):
                tensor.copy_(0.5 * torch.randn(tensor.shape, generator=generator))
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(0.2 * torch.rand(tensor.shape, generator=generator))
    return _perturb_and_save(model, path)


def save_tiny_glm_moe_dsa(path: str, seed: int = 0, **overrides) -> str:
    """A tiny GlmMoeDsaForCausalLM (GLM-5 / 5.2): multi-latent attention with the DSA indexer keeping 6 keys per
    query (below the test sequences' lengths, so the attention is sparse), 3 layers (the first dense; the third a
    GLM-5.2 "shared" indexer layer reusing the second's choice), 8 routed experts top-2, one shared expert,
    routed_scaling_factor 2.5."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                  first_k_dense_replace=1, routed_scaling_factor=2.5, index_topk=6, index_head_dim=16,
                  index_n_heads=4, indexer_types=["full", "full", "shared"], max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  pad_token_id=0)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = _spread_router(GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**fields)).float(), seed)
    with torch.no_grad():  # indexer scores of order one, so its choice is not decided by rounding
        for name, param in model.named_parameters():
            if ".indexer." in name and not name.endswith("k_norm.weight") and not name.endswith("k_norm.bias"):
                param.normal_(0.0, 0.3)
    return _perturb_and_save(model, path)


def _with_mtp_layer(path: str, rename: dict[str, str], extra: dict[str, tuple[int, ...] | str], config: dict,
                    seed: int) -> str:
    """Turn the last decoder layer of a saved checkpoint into its MTP layer: tensors whose name starts with a key of
    `rename` get that prefix replaced; `extra` adds tensors (a shape: random, a name: a copy of that tensor);
    `config` updates config.json (num_hidden_layers one less, the MTP count)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    for old, new in rename.items():
        tensors = {(new + k[len(old):] if k.startswith(old) else k): v for k, v in tensors.items()}
    generator = torch.Generator().manual_seed(seed)
    for name, spec in extra.items():
        if isinstance(spec, str):
            tensors[name] = tensors[spec].clone()
        elif len(spec) == 1:  # a norm: around 1, so a wrong mapping shows up
            tensors[name] = 1.0 + 0.1 * torch.randn(spec, generator=generator)
        else:
            tensors[name] = 0.1 * torch.randn(spec, generator=generator)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        whole = json.load(f)
    whole.update(config)
    for key in ("layer_types", "mlp_layer_types"):  # per-layer lists: the main layers only
        if isinstance(whole.get(key), list):
            whole[key] = whole[key][: whole["num_hidden_layers"]]
    with open(config_path, "w") as f:
        json.dump(whole, f, indent=2)
    return path


def save_tiny_mimo(path: str, seed: int = 0, **overrides) -> str:
    """A MiMo-shaped checkpoint (model_type "mimo": Qwen2's decoder) with one MTP layer under model.mtp_layers.0,
    spelt as the released MiMo-7B checkpoints (transformers has no MiMo class: its main model is Qwen2's)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_theta=10000.0)
    fields.update(overrides)
    torch.manual_seed(seed)
    _perturb_and_save(Qwen2ForCausalLM(Qwen2Config(**fields)).float(), path, also=("bias",))
    main, hidden = fields["num_hidden_layers"] - 1, fields["hidden_size"]
    p = "model.mtp_layers.0."
    return _with_mtp_layer(path, {f"model.layers.{main}.": p},
                           {p + "token_layernorm.weight": (hidden,), p + "hidden_layernorm.weight": (hidden,),
                            p + "input_proj.weight": (hidden, 2 * hidden), p + "final_layernorm.weight": (hidden,)},
                           dict(model_type="mimo", num_hidden_layers=main, num_nextn_predict_layers=1), seed)


def save_tiny_after_decoder_mtp(path: str, family: str, seed: int = 0) -> str:
    """The tiny DeepSeek-V3 MoE or GLM-4.7-Flash (3 decoder layers) with one MTP layer as the released checkpoints
    spell it: decoder layer 3 (an MoE layer) with enorm, hnorm, eh_proj, shared_head.norm and its copies of the
    embedding and output layer."""
    if family == "deepseek_v3":
        save_tiny_deepseek_v3_moe(path, seed, num_hidden_layers=4)
    else:
        save_tiny_glm4_moe_lite(path, seed, num_hidden_layers=4, mlp_layer_types=["dense"] + ["sparse"] * 3)
    p, hidden = "model.layers.3.", 64
    return _with_mtp_layer(path, {}, {p + "enorm.weight": (hidden,), p + "hnorm.weight": (hidden,),
                                      p + "eh_proj.weight": (hidden, 2 * hidden), p + "shared_head.norm.weight": (hidden,),
                                      p + "embed_tokens.weight": "model.embed_tokens.weight",
                                      p + "shared_head.head.weight": "lm_head.weight"},
                           dict(num_hidden_layers=3, num_nextn_predict_layers=1), seed)


def save_tiny_qwen3_next_mtp(path: str, seed: int = 0) -> str:
    """The tiny Qwen3-Next (4 decoder layers) with one MTP layer as the released checkpoints spell it: a gated
    full-attention MoE layer under mtp.layers.0, behind mtp.fc and its two norms, with mtp.norm after it."""
    kinds = ["linear_attention", "full_attention", "linear_attention", "full_attention", "full_attention"]
    save_tiny_qwen3_next(path, seed, num_hidden_layers=5, layer_types=kinds)
    hidden = _hybrid_fields()["hidden_size"]
    return _with_mtp_layer(path, {"model.layers.4.": "mtp.layers.0."},
                           {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": (hidden,),
                            "mtp.pre_fc_norm_hidden.weight": (hidden,), "mtp.norm.weight": (hidden,)},
                           dict(num_hidden_layers=4, mtp_num_hidden_layers=1), seed)


def save_tiny_qwen2_5_vl(path: str, seed: int = 0) -> str:
    """A tiny Qwen2_5_VLForConditionalGeneration that takes images: a 2-block vision tower (window attention, 4-pixel
    patches merged 2 x 2), a 2-layer multimodal-RoPE text model, a character tokenizer with the vision tokens, a
    ChatML template that renders image items, and Qwen2-VL's image processor (slime/tools/tiny_vl_checkpoint.py)."""
    from slime.tools.tiny_vl_checkpoint import TinyVLSpec, write_tiny_vl_checkpoint

    return str(write_tiny_vl_checkpoint(path, TinyVLSpec(kind="qwen2.5-vl", seed=seed)))


def save_tiny_qwen3_vl(path: str, seed: int = 0) -> str:
    """A tiny Qwen3VLForConditionalGeneration that takes images (learned vision position embeddings, one deepstack
    layer, interleaved multimodal RoPE), as save_tiny_qwen2_5_vl."""
    from slime.tools.tiny_vl_checkpoint import TinyVLSpec, write_tiny_vl_checkpoint

    return str(write_tiny_vl_checkpoint(path, TinyVLSpec(kind="qwen3-vl", seed=seed)))


def save_tiny_qwen3_5_vl(path: str, seed: int = 0) -> str:
    """A tiny Qwen3_5ForConditionalGeneration that takes images (a gated DeltaNet and a gated attention layer,
    interleaved multimodal RoPE on half of each head), as save_tiny_qwen2_5_vl: the family the trainer builds."""
    from slime.tools.tiny_vl_checkpoint import TinyVLSpec, write_tiny_vl_checkpoint

    return str(write_tiny_vl_checkpoint(path, TinyVLSpec(kind="qwen3.5-vl", seed=seed)))


def tiny_deepseek_v4_config(**overrides):
    """A DeepSeek-V4-shaped config: one layer of each attention kind (sliding, compressed sparse with m = 2 and an
    indexer keeping 3 compressed keys, heavily compressed with m' = 4) under a 6-key window, YaRN on the compress
    RoPE, 3 hyper-connection streams, a hash-routed first layer then sqrt(softplus)-routed ones (8 experts, top-2,
    a shared expert), the SwiGLU clamped at 0.5 (reached by the perturbed experts)."""
    from transformers import DeepseekV4Config

    fields = dict(
        vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=32, partial_rotary_factor=0.25, num_experts_per_tok=2,
        n_routed_experts=8, n_shared_experts=1, routed_scaling_factor=1.5, hc_mult=3, hc_sinkhorn_iters=5,
        sliding_window=6, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"], swiglu_limit=0.5, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    fields.update(overrides)
    return DeepseekV4Config(**fields)


def save_tiny_deepseek_v4(path: str, seed: int = 0, **overrides) -> str:
    """Random-init a tiny DeepseekV4ForCausalLM (fp32) with every part perturbed away from its initial value (norms,
    sinks, compressor position biases, the hyper-connections, a spread router, a routing bias, a hash table of
    distinct experts per token, experts large enough to reach the clamp, an indexer with scores of order one), so
    that a wrong mapping shows up; saved by transformers (DeepSeek's own tensor names)."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_deepseek_v4_config(**overrides)).float()
    generator = torch.Generator().manual_seed(seed)
    randn = lambda t, std: std * torch.randn(t.shape, generator=generator)  # noqa: E731
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                tensor.copy_(torch.rand(tensor.shape[0], experts, generator=generator).argsort(-1)[:, :tensor.shape[1]])
            elif name.endswith("mlp.gate.weight") or ".indexer." in name and not name.endswith("norm.weight"):
                tensor.copy_(randn(tensor, 0.5 if "gate" in name else 0.3))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.2 * torch.rand(tensor.shape, generator=generator))
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")) or ".shared_experts." in name:
                tensor.copy_(randn(tensor, 0.15))
            elif name.endswith(("sinks", "position_bias", "hc_base", ".base")):
                tensor.add_(randn(tensor, 0.5))
            elif name.endswith(("hc_fn", ".fn")):
                tensor.copy_(randn(tensor, 0.1))
            elif name.endswith(("hc_scale", ".scale")) or "norm" in name:
                tensor.add_(randn(tensor, 0.1))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


GPT_OSS_YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 128, "rope_theta": 150000.0}


def save_tiny_gpt_oss(path: str, seed: int = 0, mxfp4: bool = False, **overrides) -> str:
    """A tiny GptOssForCausalLM: 2 layers (a sliding one of window 4, a full one), GQA 4/2 with q/k/v/o biases and
    sinks, YaRN RoPE (factor 4), 4 experts top-2 with biases, a router with a bias; experts and sinks of order one,
    swiglu_limit 2 and swiglu_alpha 1.5, so the clamp, the gain and the sinks all act. `mxfp4`: the experts stored
    as the released checkpoints store them (random MXFP4 blocks and scales, quantization_config mxfp4)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                  max_position_embeddings=512, rms_norm_eps=1e-6, swiglu_limit=2.0, swiglu_alpha=1.5,
                  rope_parameters=dict(GPT_OSS_YARN), router_aux_loss_coef=0.0, pad_token_id=0)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**fields)).float()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj", "router.weight")):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("sinks", "_bias", ".bias")):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    _perturb_and_save(model, path)
    if mxfp4:
        _store_experts_as_mxfp4(path, generator)
    return path


def _store_experts_as_mxfp4(path: str, generator) -> None:
    """Replace each stacked expert weight [E, in, out] by random MXFP4 blocks [E, out, in / 32, 16] and scales
    [E, out, in / 32] (values up to 6 x 2^-2), and say so in config.json."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape
        tensors[name + "_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8,
                                                  generator=generator)
        tensors[name + "_scales"] = torch.randint(122, 126, (experts, outputs, inputs // 32), dtype=torch.uint8,
                                                  generator=generator)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


DEEPSEEK_V32_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def save_tiny_deepseek_v32(path: str, seed: int = 0, **overrides) -> str:
    """A tiny DeepseekV32ForCausalLM: multi-latent attention with the DSA indexer keeping 6 keys per query (below the
    test sequences' lengths; 8 indexer heads, so that few keys score exactly 0 after the relu: keys tied at the k-th
    score are kept in an order neither side defines), YaRN RoPE whose attention factor is not 1 (mscale 0.8 of
    mscale_all_dim 1), 2 layers (the first dense), 8 routed experts in 2 groups (one per token, top-2 in it), one
    shared expert, scaling 2.5."""
    import torch
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                  n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, index_topk=6,
                  index_head_dim=16, index_n_heads=8, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, rope_parameters=dict(DEEPSEEK_V32_YARN), pad_token_id=0)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = _spread_router(DeepseekV32ForCausalLM(DeepseekV32Config(**fields)).float(), seed)
    with torch.no_grad():  # indexer scores of order one, so its choice is not decided by rounding
        for name, param in model.named_parameters():
            if ".indexer." in name and not name.endswith(("k_norm.weight", "k_norm.bias")):
                param.normal_(0.0, 0.3)
    return _perturb_and_save(model, path)


def save_tiny_kimi_linear(path: str, seed: int = 0, **overrides) -> str:
    """A tiny KimiLinearForCausalLM: Kimi delta attention (4 heads of 8), then multi-latent attention without RoPE;
    the first layer's MLP dense, the second MoE (8 experts in 2 groups, one per token, top-2, one shared expert,
    scaling 2.5); convolutions and decays of order one, so the short convolution and the per-channel
    gate act."""
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_experts=8, num_experts_per_tok=2,
                  n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, linear_head_dim=8,
                  linear_num_heads=4, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
                  mlp_layer_types=["dense", "sparse"], rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = _spread_router(KimiLinearForCausalLM(KimiLinearConfig(**fields)).float(), seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("conv1d.weight"):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("f_b_proj.weight", "g_b_proj.weight", "f_a_proj.weight", "g_a_proj.weight")):
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith("A_log"):
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return _perturb_and_save(model, path)
