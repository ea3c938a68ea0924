"""The sample record that flows from the data source through generation and reward to training.

Field names follow upstream slime so users' plugins (custom generate / rm / rollout functions)
keep working unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch


@dataclass
class Sample:
    """One prompt + one response, with everything the trainer and metrics need."""

    group_index: int | None = None
    index: int | None = None
    # prompt: text (chat template already applied) or a list of chat messages
    prompt: str | list[dict[str, str]] = ""
    # prompt + response token ids
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    # response
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    # one entry per response token; 0 excludes the token from the loss (e.g. tool output)
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: list[list[int]] | None = None
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

    def to_dict(self) -> dict[str, Any]:
        value = dict(self.__dict__)
        value["status"] = self.status.value
        return value

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Sample":
        data = dict(data)
        data["status"] = Sample.Status(data.get("status", Sample.Status.PENDING.value))
        known = set(Sample.__dataclass_fields__)
        sample = Sample(**{k: v for k, v in data.items() if k in known})
        # unknown keys (written by plugins) survive a round trip as attributes
        for key, value in data.items():
            if key not in known:
                setattr(sample, key, value)
        return sample

    def get_reward_value(self, args) -> float:
        """The scalar reward: `reward[args.reward_key]` when rewards are dicts, else `reward`."""
        key = getattr(args, "reward_key", None)
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
        """Record the engine's weight version and map its finish reason onto `status`."""
        if "weight_version" in meta_info and meta_info["weight_version"] is not None:
            self.weight_versions.append(str(meta_info["weight_version"]))
        finish = meta_info.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else finish
        self.status = _FINISH_TO_STATUS.get(kind, Sample.Status.COMPLETED)


_FINISH_TO_STATUS = {
    "length": Sample.Status.TRUNCATED,
    "abort": Sample.Status.ABORTED,
    "stop": Sample.Status.COMPLETED,
}


@dataclass(frozen=True)
class ParamInfo:
    """Describes one parameter for weight transfer (upstream-compatible name)."""

    name: str
    dtype: torch.dtype
    shape: torch.Size
    attrs: dict
    size: int
    src_rank: int


# The dict-of-lists batch handed from rollout to training (see slime.rollout.advantages).
RolloutBatch = dict[str, list[Any]]
