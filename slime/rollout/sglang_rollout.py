"""The default rollout function: generate every group through the router's /generate, then reward.

`generate_rollout(args, rollout_id, data_source, evaluation=False)` is what `--rollout-function-path`
replaces; `generate(args, sample, sampling_params)` is what `--custom-generate-function-path`
replaces. Both keep upstream's signatures. The work runs on one background asyncio loop so the
caller (a Ray actor or a plain script) stays synchronous; every HTTP request has a deadline.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
import uuid
from typing import Any, Awaitable, Callable, TypeVar

from tqdm import tqdm

from slime.rollout.advantages import flatten_groups
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.data_source import PromptDataset, PromptFileSpec, eval_prompt_specs, load_tokenizer
from slime.rollout.metrics import compute_eval_metrics, compute_rollout_metrics
from slime.rollout.rm_hub import async_rm, batched_async_rm, load_hook
from slime.utils.http_utils import DEFAULT_TIMEOUT_S, post
from slime.utils.misc import SingletonMeta
from slime.utils.types import Sample

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_SERVER_CONCURRENCY = 512  # in-flight requests per engine (upstream's --sglang-server-concurrency)


# ---------------------------------------------------------------- background event loop

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="rollout-loop", daemon=True).start()
        return _loop


def run(coro: Awaitable[T]) -> T:
    """Run a coroutine on the rollout loop and wait for it (each request inside has its own deadline)."""
    return asyncio.run_coroutine_threadsafe(coro, _background_loop()).result()


# ---------------------------------------------------------------- one request

def generate_url(args) -> str:
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"


def request_timeout(args) -> float:
    """Deadline of one /generate call: the router's own request timeout unless overridden."""
    for name in ("rollout_request_timeout", "sglang_router_request_timeout_secs"):
        if getattr(args, name, None):
            return float(getattr(args, name))
    return DEFAULT_TIMEOUT_S


def _pick(args, name: str, evaluation: bool):
    # eval_<name> overrides rollout_<name> for evaluation when set
    value = getattr(args, f"eval_{name}", None) if evaluation else None
    return value if value is not None else getattr(args, f"rollout_{name}", None)


def sampling_params(args, evaluation: bool = False) -> dict[str, Any]:
    """SGLang sampling_params from --rollout-* flags (--eval-* overrides when evaluating)."""
    params = {
        "temperature": _pick(args, "temperature", evaluation),
        "top_p": _pick(args, "top_p", evaluation),
        "top_k": _pick(args, "top_k", evaluation),
        "max_new_tokens": _pick(args, "max_response_len", evaluation),
        "stop": getattr(args, "rollout_stop", None),
        "stop_token_ids": getattr(args, "rollout_stop_token_ids", None),
        "skip_special_tokens": getattr(args, "rollout_skip_special_tokens", False),
        # keep the stop string in the text: the tokens we train on contain it
        "no_stop_trim": True,
        # spaces_between_special_tokens is left at SGLang's default: fast (Rust) tokenizers ignore it
    }
    return {key: value for key, value in params.items() if value is not None}


def _new_tokens_and_logprobs(output: dict) -> tuple[list[int], list[float] | None]:
    entries = (output.get("meta_info") or {}).get("output_token_logprobs")
    if entries is not None:
        return [int(e[1]) for e in entries], [float(e[0]) for e in entries]
    if "output_ids" in output:
        return list(output["output_ids"]), None
    raise ValueError(f"/generate reply has neither meta_info.output_token_logprobs nor output_ids: {sorted(output)}")


def _budget(args, sample: Sample, params: dict) -> int | None:
    """New tokens still allowed (None: no limit): response budget minus what a resumed sample has, within the context."""
    limits = []
    if params.get("max_new_tokens") is not None:
        limits.append(int(params["max_new_tokens"]) - sample.response_length)
    context = getattr(args, "rollout_max_context_len", None)
    if context:
        limits.append(int(context) - len(sample.tokens))
    return min(limits) if limits else None


async def generate(args, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One /generate call: appends the response tokens, text, log-probs and mask; sets status."""
    if not sample.tokens:
        sample.tokens = list(load_tokenizer(args.hf_checkpoint)(sample.prompt, add_special_tokens=False)["input_ids"])
    params = dict(sampling_params)
    budget = _budget(args, sample, params)
    if budget is not None and budget <= 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    if budget is not None:
        params["max_new_tokens"] = budget
    # rid: engines and the rollout's error reports name the sample an outstanding request belongs to
    payload = {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True,
               "rid": f"sample{sample.index}-{uuid.uuid4().hex[:8]}"}
    output = await post(generate_url(args), payload, timeout_s=request_timeout(args))
    tokens, logprobs = _new_tokens_and_logprobs(output)
    sample.tokens = sample.tokens + tokens
    sample.response += output.get("text", "")
    sample.response_length += len(tokens)
    sample.loss_mask = (sample.loss_mask or []) + [1] * len(tokens)
    if logprobs is not None:
        sample.rollout_log_probs = (sample.rollout_log_probs or []) + logprobs
    sample.update_from_meta_info(args, output.get("meta_info") or {})
    return sample


class GenerateState(metaclass=SingletonMeta):
    """Process-wide generation state that users' custom generate functions read (upstream name)."""

    def __init__(self, args):
        self.args = args
        self.tokenizer = load_tokenizer(args.hf_checkpoint)
        self.processor = None  # multimodal processors are not supported here
        self.semaphore = asyncio.Semaphore(concurrency(args))
        self.sampling_params = sampling_params(args)


# ---------------------------------------------------------------- groups

async def gather_or_cancel(coros) -> list:
    """asyncio.gather that cancels the siblings when one fails, so no request outlives a failed rollout."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _generate_fn(args) -> Callable[..., Awaitable[Sample]]:
    path = getattr(args, "custom_generate_function_path", None)
    return load_hook(path) if path else generate


async def generate_and_rm(args, sample: Sample, params: dict, semaphore: asyncio.Semaphore) -> Sample:
    """Generate one sample under the concurrency limit; reward it unless rewards are per group."""
    fn = load_hook(sample.generate_function_path) if sample.generate_function_path else _generate_fn(args)
    async with semaphore:
        result = await fn(args, sample, params)
    if not isinstance(result, Sample):
        raise TypeError(f"generate function {getattr(fn, '__qualname__', fn)} returned {type(result).__name__}, expected Sample")
    if not getattr(args, "group_rm", False):
        result.reward = await async_rm(args, result)
    return result


async def generate_and_rm_group(args, group: list[Sample], params: dict, semaphore: asyncio.Semaphore) -> list[Sample]:
    """All samples of one prompt concurrently; with --group-rm the group is rewarded at once."""
    done = await gather_or_cancel(generate_and_rm(args, s, params, semaphore) for s in group)
    if getattr(args, "group_rm", False):
        for sample, reward in zip(done, await batched_async_rm(args, done), strict=True):
            sample.reward = reward
    return done


def concurrency(args) -> int:
    per_engine = getattr(args, "sglang_server_concurrency", None) or DEFAULT_SERVER_CONCURRENCY
    engines = max(1, (getattr(args, "rollout_num_gpus", None) or 1) // (getattr(args, "rollout_num_gpus_per_engine", None) or 1))
    return per_engine * engines


async def generate_groups(args, groups: list[list[Sample]], params: dict, desc: str) -> list[list[Sample]]:
    """Generate and reward all groups concurrently; results in input order; a tqdm bar per call."""
    semaphore = asyncio.Semaphore(concurrency(args))
    with tqdm(total=len(groups), desc=desc, mininterval=5.0) as bar:

        async def one(group: list[Sample]) -> list[Sample]:
            result = await generate_and_rm_group(args, group, params, semaphore)
            bar.update(1)
            return result

        return await gather_or_cancel(one(g) for g in groups)


# ---------------------------------------------------------------- rollout functions

def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """The default `--rollout-function-path`: rollout_batch_size groups (or every eval dataset)."""
    if evaluation:
        return run(eval_rollout(args, rollout_id))
    start = time.monotonic()
    groups = data_source.get_samples(args.rollout_batch_size)
    groups = run(generate_groups(args, groups, sampling_params(args), desc=f"rollout {rollout_id}"))
    metrics = compute_rollout_metrics(args, flatten_groups(groups))
    logger.info("rollout %d: %d samples in %.1fs, raw reward %.3f, truncated %.2f", rollout_id,
                len(flatten_groups(groups)), time.monotonic() - start, metrics["rollout/raw_reward"],
                metrics["rollout/truncated_ratio"])
    return RolloutFnTrainOutput(samples=groups, metrics=metrics)


_eval_datasets: dict[str, PromptDataset] = {}  # repr(spec) -> dataset, read once per process


def _eval_dataset(args, spec: PromptFileSpec) -> PromptDataset:
    key = repr(spec)
    if key not in _eval_datasets:
        _eval_datasets[key] = PromptDataset(spec, load_tokenizer(args.hf_checkpoint))
    return _eval_datasets[key]


def _eval_groups(args, dataset: PromptDataset) -> list[list[Sample]]:
    n = getattr(args, "n_samples_per_eval_prompt", None) or 1
    groups = []
    for group_index, prompt in enumerate(dataset.samples):
        group = [copy.deepcopy(prompt) for _ in range(n)]
        for offset, sample in enumerate(group):
            sample.group_index, sample.index = group_index, group_index * n + offset
        groups.append(group)
    return groups


def _eval_reward(args, sample: Sample) -> float:
    key = getattr(args, "eval_reward_key", None) or getattr(args, "reward_key", None)
    return float(sample.reward[key] if key else sample.reward)


async def eval_rollout(args, rollout_id: int) -> RolloutFnEvalOutput:
    """Every --eval-prompt-data dataset with the --eval-* sampling settings; metrics per dataset."""
    params = sampling_params(args, evaluation=True)
    data, metrics = {}, {}
    for name, spec in eval_prompt_specs(args).items():
        groups = _eval_groups(args, _eval_dataset(args, spec))
        samples = flatten_groups(await generate_groups(args, groups, params, f"eval {name} @ {rollout_id}"))
        rewards = [_eval_reward(args, s) for s in samples]
        data[name] = {
            "rewards": rewards,
            "truncated": [s.status == Sample.Status.TRUNCATED for s in samples],
            "samples": samples,
        }
        metrics.update(compute_eval_metrics(name, samples, rewards))
    return RolloutFnEvalOutput(data=data, metrics=metrics)
