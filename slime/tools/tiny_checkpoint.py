"""Write a tiny, randomly initialised Qwen3 (or Qwen3-MoE) HF checkpoint with a real HF tokenizer.

    python -m slime.tools.tiny_checkpoint --out DIR [--layers 2 --hidden 64 --heads 4 ...] [--alphabet 0123456789]
    python -m slime.tools.tiny_checkpoint --out DIR --num-experts 8 --moe-topk 2 --moe-ffn-hidden 32

By default the tokenizer is the real Qwen one and the vocabulary Qwen3's full 151,936 rows (it
must cover the tokenizer), so the embedding dominates the size; a small hidden size keeps loading
and CPU generation fast. With `--alphabet` the tokenizer is a character tokenizer over those
characters (slime/tools/char_tokenizer.py) and the vocabulary has one row per token. Works offline.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from slime.tools import char_tokenizer
from slime.tools.qwen_tokenizer_files import FIRST_ADDED_TOKEN_ID, QWEN3_VOCAB_SIZE, save_hf_tokenizer

IM_END_ID = FIRST_ADDED_TOKEN_ID + 2
ENDOFTEXT_ID = FIRST_ADDED_TOKEN_ID


@dataclass(frozen=True, kw_only=True)
class TinyQwen3Spec:
    """Shape of the tiny model; defaults keep a 2-core CPU demo fast."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn_hidden: int = 128
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    seed: int = 1234
    init_std: float = 0.02
    alphabet: str | None = None
    """None: the Qwen tokenizer; else a character tokenizer over these characters."""
    num_experts: int = 0
    """> 0: a Qwen3-MoE (every layer routed, softmax top-k renormalised, as Qwen3-30B-A3B)."""
    moe_topk: int = 2
    moe_ffn_hidden: int = 32


@dataclass(frozen=True, kw_only=True)
class VocabIds:
    size: int
    pad: int
    """Also bos, as in Qwen3 (<|endoftext|>)."""
    eos: tuple[int, ...]
    """The first one is config.eos_token_id; all of them end generation."""


def vocab_ids(spec: TinyQwen3Spec) -> VocabIds:
    if spec.alphabet is None:
        return VocabIds(size=QWEN3_VOCAB_SIZE, pad=ENDOFTEXT_ID, eos=(IM_END_ID, ENDOFTEXT_ID))
    specials = char_tokenizer.SPECIAL_TOKENS
    return VocabIds(size=len(specials) + len(spec.alphabet), pad=specials.index(char_tokenizer.PAD_TOKEN),
                    eos=(specials.index(char_tokenizer.EOS_TOKEN),))


def build_config(spec: TinyQwen3Spec):
    from transformers import Qwen3Config, Qwen3MoeConfig

    ids = vocab_ids(spec)
    if spec.num_experts:
        family, extra = Qwen3MoeConfig, dict(
            num_experts=spec.num_experts, num_experts_per_tok=spec.moe_topk, moe_intermediate_size=spec.moe_ffn_hidden,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
            architectures=["Qwen3MoeForCausalLM"])
    else:
        family, extra = Qwen3Config, dict(architectures=["Qwen3ForCausalLM"])
    return family(
        **extra,
        vocab_size=ids.size,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn_hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.init_std,
        bos_token_id=ids.pad,
        eos_token_id=ids.eos[0],
        pad_token_id=ids.pad,
        torch_dtype="float32",
    )


def write_tiny_checkpoint(out_dir: str | Path, spec: TinyQwen3Spec = TinyQwen3Spec()) -> Path:
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(build_config(spec)).to(torch.float32)
    if spec.num_experts:
        _spread_router(model, spec.init_std)
    model.save_pretrained(str(out), safe_serialization=True)
    ids = vocab_ids(spec)
    GenerationConfig(
        bos_token_id=ids.pad,
        eos_token_id=list(ids.eos),
        pad_token_id=ids.pad,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    ).save_pretrained(str(out))
    if spec.alphabet is None:
        save_hf_tokenizer(out, model_max_length=spec.max_position_embeddings)
    else:
        char_tokenizer.save_char_tokenizer(out, spec.alphabet, model_max_length=spec.max_position_embeddings)
    (out / "tiny_spec.json").write_text(json.dumps(spec.__dict__, indent=2) + "\n")
    return out


@torch.no_grad()
def _spread_router(model, std: float) -> None:
    """transformers initialises the router to zeros (every expert ties); random rows make routing real."""
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            param.normal_(0.0, std * 20)


def _parse(argv: list[str] | None) -> tuple[Path, TinyQwen3Spec]:
    defaults = TinyQwen3Spec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--ffn-hidden", type=int, default=defaults.ffn_hidden)
    parser.add_argument("--max-position-embeddings", type=int, default=defaults.max_position_embeddings)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--num-experts", type=int, default=0, help="> 0: a Qwen3-MoE with this many experts")
    parser.add_argument("--moe-topk", type=int, default=defaults.moe_topk)
    parser.add_argument("--moe-ffn-hidden", type=int, default=defaults.moe_ffn_hidden)
    parser.add_argument("--alphabet", default=None,
                        help="a character tokenizer over these characters instead of the Qwen tokenizer")
    ns = parser.parse_args(argv)
    spec = TinyQwen3Spec(
        layers=ns.layers,
        hidden=ns.hidden,
        heads=ns.heads,
        kv_heads=ns.kv_heads,
        head_dim=ns.head_dim,
        ffn_hidden=ns.ffn_hidden,
        max_position_embeddings=ns.max_position_embeddings,
        tie_word_embeddings=ns.tie_word_embeddings,
        seed=ns.seed,
        alphabet=ns.alphabet,
        num_experts=ns.num_experts,
        moe_topk=ns.moe_topk,
        moe_ffn_hidden=ns.moe_ffn_hidden,
    )
    if spec.num_experts and not 0 < spec.moe_topk <= spec.num_experts:
        parser.error(f"--moe-topk {spec.moe_topk} must be between 1 and --num-experts {spec.num_experts}")
    return ns.out, spec


def main(argv: list[str] | None = None) -> None:
    out, spec = _parse(argv)
    path = write_tiny_checkpoint(out, spec)
    print(f"wrote tiny {'Qwen3-MoE' if spec.num_experts else 'Qwen3'} checkpoint to {path}")


if __name__ == "__main__":
    main()
