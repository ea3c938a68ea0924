"""Reward dispatch: `--custom-rm-path` first, then the rule-based graders named by `--rm-type`.

`async_rm(args, sample)` grades one sample, `batched_async_rm(args, samples)` a group
(with `--group-rm` a custom rm receives the whole group at once). A label a rule-based grader
cannot read (none, empty, of the wrong type, naming no choice) earns reward 0 with a warning that
counts such samples, instead of a crash or a silent zero.
"""
from __future__ import annotations

import asyncio
import logging
import random
from typing import Any, Callable

import aiohttp

from slime.rollout.plugin_args import flag
from slime.utils.deadlines import REMOTE_REWARD_CALL_S
from slime.utils.misc import load_function
from slime.utils.types import Sample

from .deepscaler import get_deepscaler_rule_based_reward
from .f1 import f1_score
from .f1 import normalize_answer as normalize_f1_answer
from .gpqa import _letters, compute_gpqa_reward, label_to_letter
from .math_dapo_utils import compute_score as compute_score_dapo
from .math_utils import boxed_content, extract_boxed_answer, grade_answer_verl, grade_math_response, normalize_answer

logger = logging.getLogger(__name__)

# Upstream's names that plug-ins import from the package itself.
__all__ = ["async_rm", "batched_async_rm", "remote_rm", "grade_answer_verl", "extract_boxed_answer",
           "get_deepscaler_rule_based_reward", "compute_score_dapo", "f1_score", "compute_gpqa_reward"]

RM_TYPES = ("math", "deepscaler", "dapo", "f1", "gpqa", "remote_rm", "random")
_REMOTE_RM_RETRIES = 3
_LABEL_WARNINGS_SHOWN = 5  # the first few unreadable labels are quoted; then one line per 100
_MATH_LIKE = ("math", "deepscaler", "dapo")


class UnreadableLabels:
    """Counts the samples graded 0 because the grader could not read their label."""

    count = 0

    @classmethod
    def record(cls, rm_type: str, sample: Sample, problem: str) -> None:
        cls.count += 1
        if cls.count <= _LABEL_WARNINGS_SHOWN or cls.count % 100 == 0:
            logger.warning("--rm-type %s cannot read the label of sample %s (%s): reward 0 (%d such sample(s) so "
                           "far); fix the label column of the prompt data (--label-key)", rm_type, sample.index,
                           problem, cls.count)


def label_problem(rm_type: str, label, metadata: dict) -> str | None:
    """Why a rule-based grader cannot read `label`, or None when it can."""
    labels = label if isinstance(label, (list, tuple)) and rm_type in ("math", "deepscaler") else [label]
    if not labels:
        return "an empty list of labels"
    for item in labels:
        if item is None:
            return "no label; set --label-key"
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            return f"a {type(item).__name__} label {str(item)[:60]!r}"
        if rm_type in _MATH_LIKE and not normalize_answer(str(item)):
            return f"label {str(item)[:60]!r} holds no answer"
        if rm_type == "f1" and not normalize_f1_answer(item):
            return f"label {str(item)[:60]!r} holds no words"
        if rm_type == "gpqa" and not _gpqa_readable(item, metadata):
            return f"label {str(item)[:60]!r} names none of the choices {_letters(metadata)}"
    return None


def _gpqa_readable(label, metadata: dict) -> bool:
    """A GPQA label names a choice (a letter, an index, a choice's text), or metadata names the correct letter, or
    it is an answer text the response may contain (compute_gpqa_reward's fallback); a lone letter outside the
    choices is none of these."""
    if metadata.get("correct_letter") or label_to_letter(label, metadata, _letters(metadata)) is not None:
        return True
    return isinstance(label, str) and len(label.strip().strip("()").strip()) > 1 and bool(normalize_f1_answer(label))


def _zero_reward(rm_type: str) -> float | dict:
    return {"score": 0.0, "acc": False, "pred": "[NO LABEL]"} if rm_type == "dapo" else 0


def _rule_based(rm_type: str, response: str, label, metadata: dict) -> float | int | dict:
    graders: dict[str, Callable[[], Any]] = {
        "math": lambda: 1 if grade_math_response(response, label) else 0,
        "deepscaler": lambda: get_deepscaler_rule_based_reward(response, label),
        "dapo": lambda: compute_score_dapo(response, label),
        "f1": lambda: f1_score(response, label)[0],
        "gpqa": lambda: compute_gpqa_reward(response, label, metadata=metadata),
    }
    if rm_type not in graders:
        raise NotImplementedError(f"--rm-type {rm_type!r} is not implemented; choose one of {RM_TYPES} or --custom-rm-path")
    return graders[rm_type]()


def random_reward(args, sample: Sample) -> int:
    """`--rm-type random`: 0 or 1 with equal odds, a baseline that learns nothing (upstream's rm type). Drawn
    from --seed, the sample index and its response, so a resumed run gives the same rewards."""
    return random.Random(f"{flag(args, 'seed')}:{sample.index}:{sample.response}").randint(0, 1)


async def remote_rm(args, sample: Sample) -> Any:
    """POST {prompt, response, label} to --rm-url; the JSON reply is the reward."""
    url = args.rm_url
    if not url:
        raise ValueError("--rm-type remote_rm needs --rm-url")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    timeout = aiohttp.ClientTimeout(total=REMOTE_REWARD_CALL_S)
    for attempt in range(1, _REMOTE_RM_RETRIES + 1):
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.post(url, json=payload) as resp:
                    resp.raise_for_status()
                    return await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if attempt == _REMOTE_RM_RETRIES:
                raise RuntimeError(f"remote rm {url} failed {attempt} times for sample {sample.index}: {exc!r}") from exc
            logger.warning("remote rm %s attempt %d failed: %r; retrying", url, attempt, exc)
            await asyncio.sleep(min(2**attempt, 10))


async def async_rm(args, sample: Sample, **kwargs) -> Any:
    """Reward of one sample: per-sample or global custom rm, else the rule named by rm_type."""
    custom = sample.custom_rm_path or args.custom_rm_path
    if custom:
        return await load_function(custom)(args, sample, **kwargs)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = metadata.get("rm_type") or args.rm_type
    rm_type = rm_type.strip() if rm_type else None
    if not rm_type:
        raise ValueError("no reward: set --rm-type or --custom-rm-path")
    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    response = sample.response
    if rm_type.startswith("boxed_"):
        # "boxed_<type>": grade only the boxed part of the response
        response = boxed_content(response) or ""
        rm_type = rm_type[len("boxed_") :]
    if rm_type == "random":
        return random_reward(args, sample)
    problem = label_problem(rm_type, sample.label, metadata) if rm_type in RM_TYPES else None
    if problem is not None:
        UnreadableLabels.record(rm_type, sample, problem)
        return _zero_reward(rm_type)
    return _rule_based(rm_type, response, sample.label, metadata)


async def batched_async_rm(args, samples: list[Sample], **kwargs) -> list[Any]:
    """Rewards of a group; a custom rm (with --group-rm) receives the whole list at once."""
    custom = args.custom_rm_path
    if custom:
        return await load_function(custom)(args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, sample, **kwargs) for sample in samples)))
