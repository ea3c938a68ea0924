"""A character-level Hugging Face tokenizer over a small alphabet, built with `tokenizers`.

    python -m slime.tools.char_tokenizer --out DIR [--alphabet 0123456789]

One token per character of the alphabet, plus three special tokens; unknown characters map to
`<unk>`. It is saved as tokenizer.json + tokenizer_config.json, so `AutoTokenizer.from_pretrained`
loads it like any other fast tokenizer. The learnable CPU demo uses it: with a vocabulary of a
dozen tokens a random policy already hits the right token often enough for GRPO to learn.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)  # ids 0, 1, 2; the alphabet follows
DIGITS = "0123456789"


def build_char_tokenizer(alphabet: str, extra_special: tuple[str, ...] = ()) -> Tokenizer:
    """`extra_special`: more whole-word special tokens (e.g. a vision model's image placeholder), after the alphabet."""
    if not alphabet or len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet must be non-empty characters without repeats, got {alphabet!r}")
    vocab = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *alphabet, *extra_special))}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character alone
    tokenizer.decoder = decoders.Fuse()  # characters join without separators
    tokenizer.add_special_tokens([*SPECIAL_TOKENS, *extra_special])
    return tokenizer


def save_char_tokenizer(out_dir: str | Path, alphabet: str = DIGITS, *, model_max_length: int = 512,
                        extra_special: tuple[str, ...] = (), chat_template: str | None = None):
    """Write the tokenizer files into out_dir; returns the transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_char_tokenizer(alphabet, extra_special),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--alphabet", default=DIGITS, help="characters of the vocabulary (default: the digits)")
    ns = parser.parse_args(argv)
    tokenizer = save_char_tokenizer(ns.out, ns.alphabet)
    print(f"wrote a {len(tokenizer)}-token character tokenizer to {ns.out}")


if __name__ == "__main__":
    main()
