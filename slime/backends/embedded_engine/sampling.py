"""SGLang-compatible sampling parameters and the per-row sampler of the embedded engine."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from slime.config.engine import RETURN_ORIGINAL_LOGPROB_ENV, return_original_logprob  # noqa: F401 (the env name: re-exported)

# Accepted by SGLang but without effect here; allowed only at their neutral value so a
# request never silently samples differently from what it asked for.
_NEUTRAL_ONLY = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "spaces_between_special_tokens": True,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "logit_bias": None,
    "custom_params": None,
    "stop_regex": None,
    "beam_width": None,
    "structural_tag": None,
    "stream_interval": None,
    "watermark": None,
    "ebnf_full_assistant": False,
}
# SGLang declares these as integers and refuses other types; so does the embedded engine.
_INTEGER_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """The subset of SGLang's sampling_params the embedded engine implements."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    """Draw every token from (sampling_seed, position) alone, whatever else the batch holds; None: the
    engine's own generator."""

    @classmethod
    def from_request(cls, raw: dict[str, Any] | None) -> "SamplingParams":
        raw = dict(raw or {})
        for key, neutral in _NEUTRAL_ONLY.items():
            value = raw.pop(key, neutral)
            if value != neutral and value not in (None, [], {}):
                raise ValueError(f"sampling param {key}={value!r} is not supported by the embedded engine")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown sampling params: {unknown}")
        for key in _INTEGER_FIELDS:
            if raw.get(key) is not None and not _is_int(raw[key]):
                raise ValueError(f"sampling param {key} must be an integer (as SGLang requires), got {raw[key]!r}")
        if isinstance(raw.get("stop"), str):
            raw["stop"] = [raw["stop"]]
        for key in ("stop", "stop_token_ids"):
            if raw.get(key) is None:
                raw.pop(key, None)
            else:
                raw[key] = tuple(raw[key])
        if not all(_is_int(t) for t in raw.get("stop_token_ids", ())):
            raise ValueError(f"sampling param stop_token_ids must hold integers, got {list(raw['stop_token_ids'])}")
        for key in ("max_new_tokens", "sampling_seed"):
            if raw.get(key) is None:
                raw.pop(key, None)
        params = cls(**raw)
        params.validate()
        return params

    def validate(self) -> None:
        if self.max_new_tokens < 0 or self.min_new_tokens < 0:
            raise ValueError("max_new_tokens and min_new_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        if self.n < 1:
            raise ValueError("n must be >= 1")


def logprob_temperature(p: SamplingParams) -> float:
    """The temperature of the distribution whose log-probs SGLang 0.5 returns as output_token_logprobs.

    SGLang divides the logits by the request's temperature, takes the softmax, samples from it
    (top-k/top-p renormalise a sorted copy), and returns log of that softmax: the tempered
    distribution before top-k/top-p filtering. Temperature 0 is greedy: SGLang turns it into
    temperature 1 with top_k 1. SGLANG_RETURN_ORIGINAL_LOGPROB=1 returns temperature-1 log-probs.
    The trainer's old-policy log-probs divide by --rollout-temperature too (loss.py), so both
    sides mean the same distribution.
    """
    if p.temperature == 0 or return_original_logprob():
        return 1.0
    return p.temperature


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sample_next_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generator: torch.Generator,
    positions: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (token_ids [B], log-probs of those tokens [B]) as SGLang
    reports them (see logprob_temperature). positions[row]: the position of the token being drawn
    (needed by rows with a sampling_seed)."""
    logits = logits.float()
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for row, p in enumerate(params):
        row_generator = generator if p.sampling_seed is None else seeded_generator(p.sampling_seed, positions[row],
                                                                                  logits.device)
        tokens[row] = _sample_row(logits[row], p, row_generator)
    temperatures = torch.tensor([logprob_temperature(p) for p in params], dtype=logits.dtype,
                                device=logits.device).unsqueeze(1)
    logprobs = torch.log_softmax(logits / temperatures, dim=-1)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


def seeded_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """The generator of one draw of a seeded request: a function of (seed, position) only."""
    return torch.Generator(device=device).manual_seed((int(seed) * 1_000_003 + int(position)) % 2**63)


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    if p.temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits / p.temperature
    if p.top_k > 0 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        probs = _top_p_filter(probs, p.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = torch.sort(probs, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    outside = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    filtered = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return filtered / filtered.sum()
