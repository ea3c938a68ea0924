"""Return types of rollout functions (`--rollout-function-path`) and the call that normalises them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from slime.utils.types import Sample


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    # dataset name -> {"rewards": [...], "truncated": [...], "samples": [...]}
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


def call_rollout_fn(fn: Callable, *args, evaluation: bool, **kwargs) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """Call a rollout function; wrap a legacy bare return (list of groups / eval dict) in the output type."""
    output = fn(*args, **kwargs, evaluation=evaluation)
    if not isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        output = RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)
    if isinstance(output, RolloutFnTrainOutput):
        _check_groups(fn, output.samples)
    return output


def _check_groups(fn: Callable, samples: Any) -> None:
    # a wrong shape here would otherwise surface much later inside the trainer
    ok = isinstance(samples, list) and all(
        isinstance(group, list) and all(isinstance(s, Sample) for s in group) for group in samples
    )
    if not ok:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(f"rollout function {name} must return list[list[Sample]] (groups), got {type(samples).__name__}")
