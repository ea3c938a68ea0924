"""On-policy distillation with a teacher engine (`--use-opd --opd-type sglang`), upstream's two plug-ins:

    --custom-rm-path slime.rollout.on_policy_distillation.reward_func
    --custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards
    --rm-url http://TEACHER_HOST:PORT/generate        (an SGLang server, or this project's embedded engine)

`reward_func` asks the teacher to score the sample's prompt + response (a prefill: `max_new_tokens` 0,
`logprob_start_len` 0) at the rollout temperature, so the teacher's and the student's log-probs describe the
same tempered distributions, and keeps the teacher's log-probs of the response tokens on the sample.
`post_process_rewards` returns reward 0 for every sample: the learning signal is the per-token reverse-KL
penalty the trainer adds to the advantages (slime/backends/megatron_utils/opd.py). Both accept upstream's
form too, where the reward is the teacher's raw reply and the post-process step extracts the log-probs.
"""
from __future__ import annotations

import logging
from typing import Any

from slime.utils.deadlines import TEACHER_CALL_S
from slime.utils.http_utils import post
from slime.utils.types import Sample

logger = logging.getLogger(__name__)



def teacher_payload(args, sample: Sample) -> dict[str, Any]:
    """SGLang /generate request that scores every token of the sample without generating."""
    if not sample.tokens:
        raise ValueError(f"sample {sample.index} has no tokens for the teacher to score")
    return {
        "input_ids": list(sample.tokens),
        "sampling_params": {"temperature": float(args.rollout_temperature),
                            "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }


def teacher_response_log_probs(reply: dict[str, Any], response_length: int) -> list[float]:
    """The teacher's log-probs of the last `response_length` tokens, from its `input_token_logprobs`."""
    entries = (reply.get("meta_info") or {}).get("input_token_logprobs")
    if not entries:
        raise ValueError("the teacher's reply has no meta_info.input_token_logprobs; it must be an SGLang /generate "
                         "endpoint asked with return_logprob and logprob_start_len 0")
    scored = [entry[0] for entry in entries[1:]]  # the first token has no log-prob
    if len(scored) < response_length or any(v is None for v in scored[len(scored) - response_length:]):
        raise ValueError(f"the teacher scored {len(scored)} tokens, fewer than the {response_length} response tokens")
    return [float(v) for v in scored[len(scored) - response_length:]] if response_length else []


async def reward_func(args, sample: Sample, **kwargs) -> float:
    """Teacher log-probs of the response (kept as sample.teacher_log_probs); the reward itself is 0."""
    url = args.rm_url
    if not url:
        raise ValueError("on-policy distillation with a teacher engine needs --rm-url http://HOST:PORT/generate")
    reply = await post(url, teacher_payload(args, sample), timeout_s=TEACHER_CALL_S)
    sample.teacher_log_probs = teacher_response_log_probs(reply, sample.response_length)
    return 0.0


def post_process_rewards(args, samples: list[Sample], **kwargs) -> tuple[list[float], list[float]]:
    """(raw rewards, training rewards), all 0; a raw teacher reply left as a reward is turned into log-probs."""
    for sample in samples:
        if isinstance(sample.reward, dict) and "meta_info" in sample.reward:
            sample.teacher_log_probs = teacher_response_log_probs(sample.reward, sample.response_length)
            sample.reward = 0.0
        if sample.teacher_log_probs is None:
            raise ValueError(f"sample {sample.index} has no teacher log-probs; use --custom-rm-path "
                             "slime.rollout.on_policy_distillation.reward_func")
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)
