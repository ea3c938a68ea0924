"""Loss masks of chat conversations: which tokens of a rendered conversation the model is trained on.

The tokenizer's own chat template decides the text. A conversation is rendered one message at a time;
what an assistant message adds after the generation prompt (its content and end-of-turn marker) is
trained on (mask 1), everything else (system, user, tool messages, the `<|im_start|>assistant\\n`
header) is context (mask 0). Each piece is tokenized on its own, so the masks line up with the tokens
exactly; the pieces join at the template's turn markers, where tokenization does not merge across them.
This works for any template whose rendering of a conversation starts with its rendering of every
shorter prefix (Qwen, Llama and most others); one that rewrites earlier turns is refused by name.
"""
from __future__ import annotations

from typing import Any

TRAINED_ROLE = "assistant"


class MultiTurnLossMaskGenerator:
    """`get_loss_mask(messages, tools=None) -> (token_ids, loss_mask)` over one conversation (upstream's name).

    `tokenizer_type` (upstream's --loss-mask-type) is accepted for compatibility: the masks here come from
    the template itself, whatever the tokenizer family.
    """

    def __init__(self, tokenizer, tokenizer_type: str | None = None, chat_template_kwargs: dict | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("SFT loss masks need the tokenizer's chat template; the tokenizer of --hf-checkpoint "
                             "has none (add chat_template to its tokenizer_config.json)")
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def _render(self, messages: list[dict], *, generation_prompt: bool, tools, extra: dict) -> str:
        kwargs = {**self.chat_template_kwargs, **extra}
        if tools is not None:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kwargs)

    def segments(self, messages: list[dict], tools=None, **template_kwargs) -> list[tuple[str, int]]:
        """The rendered conversation as (text, trained) pieces in order."""
        _check_messages(messages)
        pieces: list[tuple[str, int]] = []
        done = ""
        for i, message in enumerate(messages):
            if message["role"] == TRAINED_ROLE:
                header = self._render(messages[:i], generation_prompt=True, tools=tools, extra=template_kwargs)
                pieces.append((_suffix(done, header, i), 0))
                done = header
            rendered = self._render(messages[:i + 1], generation_prompt=False, tools=tools, extra=template_kwargs)
            pieces.append((_suffix(done, rendered, i), int(message["role"] == TRAINED_ROLE)))
            done = rendered
        return [(text, trained) for text, trained in pieces if text]

    def get_loss_mask(self, messages: list[dict], tools=None, **template_kwargs) -> tuple[list[int], list[int]]:
        """Token ids of the whole conversation and one mask entry per token (1: an assistant turn's token)."""
        token_ids: list[int] = []
        loss_mask: list[int] = []
        for text, trained in self.segments(messages, tools=tools, **template_kwargs):
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            token_ids += ids
            loss_mask += [trained] * len(ids)
        return token_ids, loss_mask

    @staticmethod
    def get_response_lengths(loss_masks: list[list[int]]) -> list[int]:
        """Tokens from the first trained token to the end, per conversation (the part the trainer scores)."""
        lengths = []
        for mask in loss_masks:
            if 1 not in mask:
                raise ValueError("a conversation has no assistant message to train on")
            lengths.append(len(mask) - mask.index(1))
        return lengths


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"SFT needs a conversation (a list of {{'role', 'content'}} messages), got "
                         f"{type(messages).__name__}: set --input-key to the messages column and do not pass "
                         "--apply-chat-template (the loss masks come from rendering each turn)")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"every message needs a 'role' (and 'content'); got {str(message)[:80]!r}")


def _suffix(done: str, rendered: str, index: int) -> str:
    if not rendered.startswith(done):
        raise ValueError(f"the chat template renders messages[:{index + 1}] without the rendering of the earlier "
                         "messages as its start (it rewrites earlier turns), so per-turn loss masks cannot be cut "
                         "from it; use a template that renders each turn independently")
    return rendered[len(done):]
