"""The sample record that flows from the data source through generation and reward to training.

Field names follow upstream slime so users' plugins (custom generate / rm / rollout functions)
keep working unchanged.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import torch

from slime.utils.rollout_batch import RolloutBatch  # noqa: F401 (upstream's import path of the batch type)


@dataclass
class Sample:
    """One prompt + one response, with everything the trainer and metrics need."""

    group_index: int | None = None
    index: int | None = None
    # one rollout execution; samples split from one execution (agent sub-trajectories) share it
    rollout_id: int | None = None
    # prompt: text (chat template already applied) or a list of chat messages
    prompt: str | list[dict[str, str]] = ""
    # prompt + response token ids
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    # extra keyword arguments of the tokenizer's apply_chat_template for this sample (e.g. enable_thinking)
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    # response
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    # one entry per response token; 0 excludes the token from the loss (e.g. tool output)
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    # top-p replay in CSR form: the kept token ids of every response token, offsets of length response_length + 1
    rollout_top_p_token_ids: list[int] | torch.Tensor | None = None
    rollout_top_p_token_offsets: list[int] | torch.Tensor | None = None
    rollout_routed_experts: str | None = None  # base64 int32 [tokens, MoE layers, top-k] (routing replay)
    # True: kept for bookkeeping but contributes no loss
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        # recoverable failure (tool error, parse error): may hold partial valid output
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    # per-sample training hints (e.g. which loss to use)
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo:
        """Speculative-decoding counters summed over every engine call of the sample."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        @property
        def spec_accept_rate(self) -> float:
            return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num else 0.0

        @property
        def spec_accept_length(self) -> float:
            return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct else 0.0

        def add(self, meta_info: dict) -> None:
            self.spec_accept_token_num += int(meta_info.get("spec_accept_token_num", 0) or 0)
            self.spec_draft_token_num += int(meta_info.get("spec_draft_token_num", 0) or 0)
            self.spec_verify_ct += int(meta_info.get("spec_verify_ct", 0) or 0)
            self.completion_token_num += int(meta_info.get("completion_tokens", 0) or 0)

    @dataclass
    class PrefixCacheInfo:
        """Prompt tokens the engine served from its prefix cache, summed over calls."""

        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        @property
        def prefix_cache_hit_rate(self) -> float:
            return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

        def add(self, meta_info: dict) -> None:
            self.cached_tokens += int(meta_info.get("cached_tokens", 0) or 0)
            self.total_prompt_tokens += int(meta_info.get("prompt_tokens", 0) or 0)

    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    @property
    def rollout_top_p_offsets(self) -> list[int] | torch.Tensor | None:
        """Short name of rollout_top_p_token_offsets (plug-ins use both)."""
        return self.rollout_top_p_token_offsets

    @rollout_top_p_offsets.setter
    def rollout_top_p_offsets(self, value: list[int] | torch.Tensor | None) -> None:
        self.rollout_top_p_token_offsets = value

    def to_dict(self) -> dict[str, Any]:
        """Plain data (status as its string, the info records as dicts); from_dict inverts it."""
        value = dict(self.__dict__)
        value["status"] = self.status.value
        value["spec_info"] = asdict(self.spec_info)
        value["prefix_cache_info"] = asdict(self.prefix_cache_info)
        return value

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Sample":
        data = dict(data)
        data["status"] = Sample.Status(data.get("status", Sample.Status.PENDING.value))
        data["spec_info"] = Sample.SpecInfo(**(data.get("spec_info") or {}))
        data["prefix_cache_info"] = Sample.PrefixCacheInfo(**(data.get("prefix_cache_info") or {}))
        known = set(Sample.__dataclass_fields__)
        sample = Sample(**{k: v for k, v in data.items() if k in known})
        # unknown keys (written by plugins) survive a round trip as attributes
        for key, value in data.items():
            if key not in known:
                setattr(sample, key, value)
        return sample

    def get_reward_value(self, args) -> float:
        """The scalar reward: `reward[args.reward_key]` when rewards are dicts, else `reward`."""
        key = args.reward_key
        if key:
            if not isinstance(self.reward, dict) or key not in self.reward:
                raise KeyError(f"--reward-key {key!r} not in reward {self.reward!r} of sample {self.index}")
            return self.reward[key]
        if isinstance(self.reward, dict):
            raise TypeError(f"sample {self.index} has a dict reward {sorted(self.reward)}; set --reward-key")
        return self.reward

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def update_from_meta_info(self, args, meta_info: dict[str, Any]) -> None:
        """Fold one engine reply's meta_info in: weight version, cache/spec counters, status from the finish reason.

        An unknown (or missing) finish reason leaves the status as it was.
        """
        # set only when --sglang-speculative-algorithm is passed through (sglang_passthrough mirrors it on args)
        if getattr(args, "sglang_speculative_algorithm", None):
            self.spec_info.add(meta_info)
        self.prefix_cache_info.add(meta_info)
        if meta_info.get("weight_version") is not None:
            self.weight_versions.append(str(meta_info["weight_version"]))
        finish = meta_info.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else finish
        self.status = _FINISH_TO_STATUS.get(kind, self.status)

    def append_response_tokens(
        self,
        args=None,
        *,
        tokens: list[int] | None = None,
        log_probs: list[float] | None = None,
        trainable: bool = True,
        meta_info: dict[str, Any] | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Append response tokens (a model turn, or a tool/environment reply) keeping every per-token list aligned.

        Model tokens (trainable) carry the engine's log-probs and loss-mask 1; tool tokens (trainable=False)
        get loss-mask 0 and log-prob 0.0, so `tokens`, `loss_mask` and `rollout_log_probs` keep one entry per
        response token. With `update_terminal_info`, `meta_info` also updates the status and weight versions.
        """
        tokens = [int(t) for t in (tokens or [])]
        log_probs = None if log_probs is None else [float(p) for p in log_probs]
        if trainable and tokens and log_probs is None:
            raise ValueError("trainable (model) tokens need the engine's log-probs")
        if not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable (tool) tokens take no log-probs; they are masked out of the loss")
            log_probs = [0.0] * len(tokens)
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"{len(log_probs)} log-probs for {len(tokens)} tokens")
        before = self.response_length
        if self.rollout_log_probs is None and before and trainable and tokens:
            raise ValueError("cannot add log-probs to a response whose earlier tokens have none")
        self.tokens = self.tokens + tokens
        self.response_length = before + len(tokens)
        self.loss_mask = (self.loss_mask if self.loss_mask is not None else [1] * before) + [int(trainable)] * len(tokens)
        if log_probs:
            self.rollout_log_probs = (self.rollout_log_probs or [0.0] * before) + log_probs
        if text:
            self.response += text
        if meta_info is not None and update_terminal_info:
            self.update_from_meta_info(args, meta_info)


_FINISH_TO_STATUS = {
    "length": Sample.Status.TRUNCATED,
    "abort": Sample.Status.ABORTED,
    "stop": Sample.Status.COMPLETED,
}
