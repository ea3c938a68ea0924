"""Tokenizer and processor loading with upstream's names (example plug-ins import these).

`load_tokenizer(name_or_path, **kwargs)` and `load_processor(name_or_path, **kwargs)` wrap transformers'
Auto classes; `build_processor_kwargs(multimodal_inputs)` is the keyword set a multimodal processor is
called with: text ids as plain lists, media features as torch tensors. Multimodal training itself is not
supported here (--multimodal-keys is refused); the functions exist so plug-ins that import them load.
"""
from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

MEDIA_KWARGS = ("audio_kwargs", "images_kwargs", "videos_kwargs")
# A tokenizer directory holds one of these (fast, sentencepiece, or byte-level BPE vocabulary + merges).
_TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def load_tokenizer(name_or_path: str, **kwargs):
    """AutoTokenizer of a model directory (its tokenizer files checked first) or hub name."""
    from transformers import AutoTokenizer

    if os.path.isdir(name_or_path):
        check_tokenizer_files(name_or_path)
    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def check_tokenizer_files(path: str) -> None:
    """Raise FileNotFoundError naming what is missing when `path` holds no complete tokenizer."""
    present = set(os.listdir(path))
    if any(all(name in present for name in names) for names in _TOKENIZER_FILES):
        return
    partial = [name for names in _TOKENIZER_FILES for name in names if name in present]
    found = f" (found {partial}, but not the file it needs next to it)" if partial else ""
    raise FileNotFoundError(
        f"--hf-checkpoint {path} has no tokenizer{found}: expected tokenizer.json, or tokenizer.model, or "
        "vocab.json + merges.txt, next to config.json; copy them from the model's HF repository")


def load_processor(name_or_path: str, **kwargs):
    """The model's multimodal processor, or None when it has none (a text model's AutoProcessor is its tokenizer)."""
    from transformers import AutoProcessor, PreTrainedTokenizerBase

    try:
        processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        logger.info("no processor for %s (%s)", name_or_path, exc)
        return None
    return None if isinstance(processor, PreTrainedTokenizerBase) else processor


def build_processor_kwargs(multimodal_inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Processor call keywords: the inputs, text as lists (no tensors, no mm token type ids), media as tensors."""
    result = dict(multimodal_inputs or {})
    result["text_kwargs"] = {**result.get("text_kwargs", {}), "return_tensors": None, "return_mm_token_type_ids": False}
    for key in MEDIA_KWARGS:
        result[key] = {**result.get(key, {}), "return_tensors": "pt"}
    return result
