"""Write a tiny, randomly initialised vision + text checkpoint that takes images (Qwen2.5-VL, Qwen3-VL, Qwen3.5).

    python -m slime.tools.tiny_vl_checkpoint --out DIR [--kind KIND] [--seed 0]

KIND is qwen2.5-vl, qwen3-vl, qwen3-vl-moe, qwen3.5-vl or qwen3.5-vl-moe. The model is transformers' own class
(Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration,
Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration: one gated DeltaNet and one gated attention
layer) at toy sizes: a 2-layer text model of width 64 with multimodal RoPE (MoE: 4 experts, top 2; Qwen3.5-MoE
with a gated shared expert; Qwen3-VL-MoE's fused experts in Qwen's released layout), a 2-block vision tower on
4-pixel patches merged 2 x 2, so a 32 x 32 picture is 16 image tokens. The tokenizer is a character tokenizer
(slime/tools/char_tokenizer.py) over digits, lower-case letters and a little punctuation, plus the chat and
vision special tokens, with a ChatML template that renders an image item as
`<|vision_start|><|image_pad|><|vision_end|>`; the image processor (preprocessor_config.json) is Qwen2-VL's,
bounded to 16 x 16 .. 64 x 64 pixels. Works offline.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from slime.tools import char_tokenizer

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz ?.,:"
CHAT_TOKENS = ("<|im_start|>",)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
KINDS = ("qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "qwen3.5-vl", "qwen3.5-vl-moe")
# The text attention's q and k weights are scaled up so a random model's attention scores are of order one: what
# each token attends to then depends on the positions, and a wrong position row changes the log-probs visibly.
QK_SCALE = 8.0
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# ChatML; an image item (any dict of type image) is the model's image placeholder between its vision markers.
VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True, kw_only=True)
class TinyVLSpec:
    kind: str = "qwen2.5-vl"
    seed: int = 0
    layers: int = 2
    hidden: int = 64
    vision_depth: int = 2
    vision_hidden: int = 32
    patch_size: int = 4
    merge_size: int = 2
    min_pixels: int = 16 * 16
    max_pixels: int = 64 * 64
    max_position_embeddings: int = 2048


def token_ids() -> dict[str, int]:
    """Ids of the special tokens, in the tokenizer's order (specials, alphabet, chat and vision tokens)."""
    names = (*char_tokenizer.SPECIAL_TOKENS, *ALPHABET, *CHAT_TOKENS, *VISION_TOKENS)
    return {name: index for index, name in enumerate(names)}


def build_config(spec: TinyVLSpec):
    import transformers

    ids = token_ids()
    vocab = len(ids)
    head_dim = 16
    text = dict(vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
                num_hidden_layers=spec.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
                bos_token_id=ids[char_tokenizer.PAD_TOKEN], eos_token_id=ids[char_tokenizer.EOS_TOKEN],
                pad_token_id=ids[char_tokenizer.PAD_TOKEN])
    vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
                  num_heads=2, in_channels=3, patch_size=spec.patch_size, spatial_merge_size=spec.merge_size,
                  temporal_patch_size=2, out_hidden_size=spec.hidden)
    if spec.kind == "qwen2.5-vl":
        vision.update(window_size=4 * spec.patch_size * spec.merge_size, fullatt_block_indexes=[spec.vision_depth - 1])
        config_class = transformers.Qwen2_5_VLConfig
    elif spec.kind in ("qwen3-vl", "qwen3-vl-moe"):
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0])
        text["rope_parameters"]["mrope_interleaved"] = True
        config_class = transformers.Qwen3VLConfig
        if spec.kind == "qwen3-vl-moe":  # experts of a width whose fused tensors are not square (their layout shows)
            text.update(MOE, moe_intermediate_size=24, decoder_sparse_step=1)
            config_class = transformers.Qwen3VLMoeConfig
    elif spec.kind in ("qwen3.5-vl", "qwen3.5-vl-moe"):  # gated DeltaNet and gated attention layers
        vision.update(num_position_embeddings=64)
        text.update(layer_types=["linear_attention", "full_attention"] * (spec.layers // 2), linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                    linear_conv_kernel_dim=4)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                   "mrope_section": [2, 1, 1], "mrope_interleaved": True}
        config_class = transformers.Qwen3_5Config
        if spec.kind == "qwen3.5-vl-moe":  # every layer routes, beside a gated shared expert
            text.pop("intermediate_size")
            text.update(MOE, shared_expert_intermediate_size=32)
            config_class = transformers.Qwen3_5MoeConfig
    else:
        raise ValueError(f"unknown kind {spec.kind!r}; one of {KINDS}")
    return config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def model_class(kind: str):
    import transformers

    return {"qwen2.5-vl": transformers.Qwen2_5_VLForConditionalGeneration,
            "qwen3-vl": transformers.Qwen3VLForConditionalGeneration,
            "qwen3-vl-moe": transformers.Qwen3VLMoeForConditionalGeneration,
            "qwen3.5-vl": transformers.Qwen3_5ForConditionalGeneration,
            "qwen3.5-vl-moe": transformers.Qwen3_5MoeForConditionalGeneration}[kind]


def write_tiny_vl_checkpoint(out_dir: str | Path, spec: TinyVLSpec = TinyVLSpec()) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    model = model_class(spec.kind)(build_config(spec)).float()
    with torch.no_grad():  # non-trivial norms, so a wrong mapping of them shows up
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            if "language_model." in name and name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(QK_SCALE)
    model.save_pretrained(str(out))
    if spec.kind == "qwen3-vl-moe":
        write_released_expert_layout(out)
    write_processing_files(out, spec)
    return out


def write_released_expert_layout(out: Path) -> None:
    """Qwen3-VL-MoE's fused experts as Qwen's released checkpoints store them (gate_up_proj [E, H, 2I], down_proj
    [E, I, H]; what SGLang reads), not as transformers 5 saves them (its in-memory [E, 2I, H], [E, H, I]);
    transformers reads either, transposing a tensor whose shape is not the in-memory one."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    fused = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
    save_file({name: t.transpose(-1, -2).contiguous() if name.endswith(fused) else t for name, t in tensors.items()},
              str(path), metadata={"format": "pt"})


def write_processing_files(out: Path, spec: TinyVLSpec) -> None:
    """The generation config, the character tokenizer with the chat and vision tokens, and Qwen2-VL's image
    processor at the spec's patching and pixel bounds (what a checkpoint directory needs to take images)."""
    from transformers import GenerationConfig, Qwen2VLImageProcessorPil

    ids = token_ids()
    GenerationConfig(bos_token_id=ids[char_tokenizer.PAD_TOKEN], eos_token_id=[ids[char_tokenizer.EOS_TOKEN]],
                     pad_token_id=ids[char_tokenizer.PAD_TOKEN], do_sample=True, temperature=1.0, top_p=1.0,
                     top_k=0).save_pretrained(str(out))
    char_tokenizer.save_char_tokenizer(out, ALPHABET, model_max_length=spec.max_position_embeddings,
                                       extra_special=(*CHAT_TOKENS, *VISION_TOKENS), chat_template=VL_CHAT_TEMPLATE)
    Qwen2VLImageProcessorPil(patch_size=spec.patch_size, merge_size=spec.merge_size, temporal_patch_size=2,
                             min_pixels=spec.min_pixels, max_pixels=spec.max_pixels).save_pretrained(str(out))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--kind", choices=KINDS, default="qwen2.5-vl")
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    path = write_tiny_vl_checkpoint(ns.out, TinyVLSpec(kind=ns.kind, seed=ns.seed))
    print(f"wrote a tiny {ns.kind} checkpoint to {path}")


if __name__ == "__main__":
    main()
