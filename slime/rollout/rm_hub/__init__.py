"""Reward dispatch: `--custom-rm-path` first, then the rule-based graders named by `--rm-type`.

`async_rm(args, sample)` grades one sample, `batched_async_rm(args, samples)` a group
(with `--group-rm` a custom rm receives the whole group at once).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import aiohttp

from slime.utils.types import Sample

from .deepscaler import get_deepscaler_rule_based_reward
from .f1 import f1_score
from .gpqa import compute_gpqa_reward
from .math_dapo_utils import compute_score as compute_score_dapo
from .math_utils import extract_answer, grade_math_response

logger = logging.getLogger(__name__)

RM_TYPES = ("math", "deepscaler", "dapo", "f1", "gpqa", "remote_rm")
_REMOTE_RM_RETRIES = 3
_REMOTE_RM_TIMEOUT_S = 120.0


def load_hook(path: str) -> Callable:
    """Import a user hook `pkg.module.func` (through slime.utils.misc.load_function)."""
    from slime.utils.misc import load_function

    return load_function(path)


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


async def remote_rm(args, sample: Sample) -> Any:
    """POST {prompt, response, label} to --rm-url; the JSON reply is the reward."""
    url = getattr(args, "rm_url", None)
    if not url:
        raise ValueError("--rm-type remote_rm needs --rm-url")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    timeout = aiohttp.ClientTimeout(total=getattr(args, "rm_timeout", None) or _REMOTE_RM_TIMEOUT_S)
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
    custom = sample.custom_rm_path or getattr(args, "custom_rm_path", None)
    if custom:
        return await load_hook(custom)(args, sample, **kwargs)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = (metadata.get("rm_type") or getattr(args, "rm_type", None) or "").strip()
    if not rm_type:
        raise ValueError("no reward: set --rm-type or --custom-rm-path")
    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    response = sample.response
    if rm_type.startswith("boxed_"):
        # "boxed_<type>": grade only the boxed part of the response
        response = extract_answer(response) or ""
        rm_type = rm_type[len("boxed_") :]
    return _rule_based(rm_type, response, sample.label, metadata)


async def batched_async_rm(args, samples: list[Sample], **kwargs) -> list[Any]:
    """Rewards of a group; a custom rm (with --group-rm) receives the whole list at once."""
    custom = getattr(args, "custom_rm_path", None)
    if custom:
        return await load_hook(custom)(args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, sample, **kwargs) for sample in samples)))
