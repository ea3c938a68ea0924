"""The default rollout function: generate groups through the router's /generate, reward, filter.

`generate_rollout(args, rollout_id, data_source, evaluation=False)` is what `--rollout-function-path`
replaces; `generate(args, sample, sampling_params)` is what `--custom-generate-function-path`
replaces; `generate_and_rm(args, sample, sampling_params, evaluation=False)` is the per-sample
step custom rollout functions reuse. All keep upstream's signatures. The work runs on one
background asyncio loop so the caller (a Ray actor or a plain script) stays synchronous; every
HTTP request has a deadline. Over-sampling, dynamic filtering and partial rollout live in
`sampling_loop.py`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import logging
import threading
import time
import uuid
from typing import Any, Awaitable, TypeVar

from tqdm import tqdm

from slime.config.run_config import run_config_of
from slime.rollout import generation_gate
from slime.rollout.train_data import flatten_groups
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.data_source import (PromptDataset, PromptFileSpec, eval_datasets, eval_prompt_specs, load_tokenizer,
                                      vision_of)
from slime.rollout.eval_config import EvalDatasetSpec
from slime.rollout.metrics import compute_eval_metrics, compute_rollout_metrics
from slime.rollout.plugin_args import flag as plugin_flag
from slime.rollout.prompt_media import UNTRAINED_IMAGES
from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.rollout.sample_hooks import apply_rollout_sample_hooks
from slime.rollout.sampling_loop import SamplingLoop
from slime.rollout.sampling_seed import seeded_params
from slime.utils.http_utils import post
from slime.utils.misc import SingletonMeta, load_function
from slime.utils.types import Sample
from slime.utils.vision_processor import image_uri, images_digest, load_vision_processor

logger = logging.getLogger(__name__)
T = TypeVar("T")



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
    return spawn(coro).result()


def spawn(coro: Awaitable[T]) -> "concurrent.futures.Future[T]":
    """Start a coroutine on the rollout loop without waiting for it (a background generator)."""
    return asyncio.run_coroutine_threadsafe(coro, _background_loop())


# ---------------------------------------------------------------- one request

def generate_url(args) -> str:
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"


def request_timeout(args) -> float:
    """Deadline of one /generate call: the router's request timeout (--sglang-router-request-timeout-secs)."""
    return float(plugin_flag(args, "sglang_router_request_timeout_secs"))  # also of args a plug-in built


# SGLang sampling parameter -> (rollout flag dest, eval flag dest); the eval one wins when evaluating and set
_SAMPLING_FLAGS = {
    "temperature": ("rollout_temperature", "eval_temperature"),
    "top_p": ("rollout_top_p", "eval_top_p"),
    "top_k": ("rollout_top_k", "eval_top_k"),
    "max_new_tokens": ("rollout_max_response_len", "eval_max_response_len"),
}


def _pick(args, name: str, evaluation: bool):
    rollout_dest, eval_dest = _SAMPLING_FLAGS[name]
    value = getattr(args, eval_dest) if evaluation else None
    return value if value is not None else getattr(args, rollout_dest)


def sampling_params(args, evaluation: bool = False) -> dict[str, Any]:
    """SGLang sampling_params from --rollout-* flags (--eval-* overrides when evaluating)."""
    params = {
        **{name: _pick(args, name, evaluation) for name in _SAMPLING_FLAGS},
        "min_new_tokens": args.eval_min_new_tokens if evaluation else None,
        "stop": args.rollout_stop,
        "stop_token_ids": args.rollout_stop_token_ids,
        "skip_special_tokens": args.rollout_skip_special_tokens,
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
    context = args.rollout_max_context_len
    if context:
        limits.append(int(context) - len(sample.tokens))
    return min(limits) if limits else None


def check_sample_media(args, sample: Sample) -> None:
    """Before any engine sees a sample: only images (videos and audio are refused), and images only when the
    run's trainer takes them (--multimodal-keys: it builds the vision tower) or the run does not train
    (--debug-rollout-only)."""
    media = {**(sample.multimodal_inputs or {}), **(sample.multimodal_train_inputs or {})}
    refused = sorted(key for key, value in (sample.multimodal_inputs or {}).items()
                     if key != "images" and value is not None)
    if refused:
        raise ValueError(f"sample {sample.index} carries {', '.join(refused)}: only images are supported")
    if any(value is not None for value in media.values()) and plugin_flag(args, "multimodal_keys") is None \
            and not plugin_flag(args, "debug_rollout_only"):
        raise ValueError(f"sample {sample.index} carries multimodal inputs ({', '.join(sorted(media))}); "
                         f"{UNTRAINED_IMAGES}. Pass --multimodal-keys, train on text samples, or run the rollout "
                         "alone (--debug-rollout-only)")


def _has_images(sample: Sample) -> bool:
    return bool((sample.multimodal_inputs or {}).get("images"))


def image_data(sample: Sample, processor) -> list[str] | None:
    """The sample's images as SGLang's /generate takes them (`image_data`, data URIs), after setting what the
    trainer takes with it (`multimodal_train_inputs`: the processor's pixel values and grids); None without
    images. The prompt's image tokens must be the processor's count for each image."""
    if not _has_images(sample):
        return None
    images = sample.multimodal_inputs["images"]
    if processor is None:
        raise ValueError(f"sample {sample.index} has images, but --hf-checkpoint has no image processor "
                         "(preprocessor_config.json) and vision tower (config.json's vision_config)")
    images = [image_uri(image) for image in images]
    sample.multimodal_inputs["images"] = images
    processed = processor.process(images)
    prompt = sample.tokens[:len(sample.tokens) - sample.response_length]
    if processor.expand_runs(prompt, processed) != prompt:
        raise ValueError(f"sample {sample.index}: its prompt's image tokens are not the processor's "
                         f"{processor.tokens_per_image(processed)} for its {len(images)} image(s)")
    if sample.multimodal_train_inputs is None:
        sample.multimodal_train_inputs = processed.as_train_inputs()
        sample.multimodal_train_input_id = images_digest(images)
    return images


def _check_image_prompt(sample: Sample, sent: int, output: dict, url: str) -> None:
    """The engine expanded the images into as many prompt tokens as the processor here did (a different
    processor configuration, e.g. other min/max pixels, would give other pixel values than the trainer's)."""
    prompt_tokens = (output.get("meta_info") or {}).get("prompt_tokens")
    if prompt_tokens is not None and int(prompt_tokens) != sent:
        raise ValueError(f"{url} read sample {sample.index}'s prompt as {prompt_tokens} tokens, the processor here "
                         f"as {sent}: the engine's image processor differs from --hf-checkpoint's "
                         "preprocessor_config.json (min/max pixels, patch or merge size)")


async def generate(args, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One /generate call: appends the response tokens, text and log-probs (loss mask 1); sets status.

    A sample aborted in an earlier rollout (--partial-rollout) continues from the tokens it has.
    """
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise ValueError(f"sample {sample.index} is {sample.status.value}; only pending or aborted samples generate")
    check_sample_media(args, sample)
    if not sample.tokens:
        if not isinstance(sample.prompt, str):
            raise ValueError(f"sample {sample.index}: the prompt is a list of chat messages; pass --apply-chat-template "
                             "to render it (or --rollout-function-path slime.rollout.sft_rollout.generate_rollout "
                             "to train on the conversation)")
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
    if args.use_rollout_routing_replay:
        payload["return_routed_experts"] = True
    images = image_data(sample, GenerateState(args).processor) if _has_images(sample) else None
    if images:
        payload["image_data"] = images
    output = await post(generate_url(args), payload, timeout_s=request_timeout(args))
    if images:
        _check_image_prompt(sample, len(payload["input_ids"]), output, generate_url(args))
    tokens, logprobs = _new_tokens_and_logprobs(output)
    if payload.get("return_routed_experts"):
        sample.rollout_routed_experts = routed_experts_of(output, generate_url(args))
    if logprobs is None:
        raise ValueError(f"{generate_url(args)} returned no meta_info.output_token_logprobs although "
                         "return_logprob was requested")
    sample.append_response_tokens(args, tokens=tokens, log_probs=logprobs, trainable=True,
                                  meta_info=output.get("meta_info") or {}, text=output.get("text", ""))
    if sample.status == Sample.Status.ABORTED and budget is not None and len(tokens) >= budget:
        sample.status = Sample.Status.TRUNCATED  # the abort came after its last allowed token: nothing is left
    return sample


def routed_experts_of(output: dict, url: str) -> str:
    """meta_info.routed_experts (base64 int32 [tokens, MoE layers, top-k], the whole sequence: each call's
    routes cover what the earlier calls of a multi-turn sample generated too)."""
    routes = (output.get("meta_info") or {}).get("routed_experts")
    if not routes:
        raise ValueError(f"{url} returned no meta_info.routed_experts although --use-rollout-routing-replay asked "
                         "for them (SGLang: launch the engines with --enable-return-routed-experts)")
    return routes


class GenerateState(metaclass=SingletonMeta):
    """Process-wide generation state that users' custom generate functions read (upstream name).

    Plug-ins may stand in their own state (upstream's has no `rollout_id`): the code here needs only
    `semaphore` and reads `aborted` and `rollout_id` as optional (False / None when absent)."""

    def __init__(self, args):
        self.args = args
        self.tokenizer = load_tokenizer(args.hf_checkpoint)
        self._processor: tuple = ()  # loaded at the first sample with images
        self.semaphore = asyncio.Semaphore(concurrency(args))
        self.sampling_params = sampling_params(args)
        self.reset()

    @property
    def processor(self):
        """A vision checkpoint's image processing (slime/utils/vision_processor.py); None for a text model. Read
        when a sample has images, so a text run on a vision checkpoint never depends on its image processor."""
        if not self._processor:
            self._processor = (load_vision_processor(self.args.hf_checkpoint, self.tokenizer),)
        return self._processor[0]

    def reset(self, rollout_id: int | None = None) -> None:
        """Start of a rollout (or eval): nothing aborted yet."""
        self.rollout_id = rollout_id
        self.aborted = False


# ---------------------------------------------------------------- per sample and per group

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


async def _call_generate(args, sample: Sample, params: dict, evaluation: bool) -> Sample | list[Sample]:
    # a function set on the sample wins over --custom-generate-function-path (upstream's order)
    path = sample.generate_function_path or args.custom_generate_function_path
    fn = load_function(path) if path else generate
    # upstream passes `evaluation` only to functions that declare it
    if "evaluation" in inspect.signature(fn).parameters:
        result = await fn(args, sample, params, evaluation=evaluation)
    else:
        result = await fn(args, sample, params)
    if isinstance(result, Sample) or (isinstance(result, list) and result and all(isinstance(s, Sample) for s in result)):
        return result
    raise TypeError(f"generate function {path or 'generate'} returned {type(result).__name__}; "
                    "expected a Sample or a non-empty list[Sample]")


def _check_images_processed(result: Sample | list[Sample]) -> None:
    """A sample that generated with images carries the processor's pixel values for the trainer (a custom
    generate function sets them with `image_data(sample, GenerateState(args).processor)`)."""
    for sample in _as_list(result):
        if sample.response_length and (sample.multimodal_inputs or {}).get("images") \
                and sample.multimodal_train_inputs is None:
            raise ValueError(f"sample {sample.index} generated with images but carries no multimodal_train_inputs "
                             "(the processor's pixel values the trainer needs): set them in the generate function")


def _as_list(result: Sample | list[Sample]) -> list[Sample]:
    return result if isinstance(result, list) else [result]


async def generate_and_rm(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample | list[Sample]:
    """Generate one sample (custom generate functions may return several) and reward it.

    Samples that are already complete (resumed from the partial-rollout buffer) are returned as they
    are; aborted ones are returned unrewarded. With --group-rm the reward is given per group instead.
    """
    state = GenerateState(args)
    if args.partial_rollout and args.mask_offpolicy_in_partial_rollout \
            and sample.response_length > 0:
        sample.loss_mask = [0] * sample.response_length  # tokens of an earlier policy: not trained on
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        return sample
    check_sample_media(args, sample)  # before any engine sees it, whichever generate function runs
    async with state.semaphore:
        # the rollout has enough groups, or a weight push is under way: leave this one for later
        if getattr(state, "aborted", False) or generation_gate.is_held():
            sample.status = Sample.Status.ABORTED
            return sample
        rollout_id = getattr(state, "rollout_id", None)
        params = seeded_params(args, sampling_params, rollout_id, sample.index, evaluation)
        result = await _call_generate(args, sample, params, evaluation)
    _check_images_processed(result)
    result = await apply_rollout_sample_hooks(args, result, rollout_id=rollout_id, evaluation=evaluation)
    samples = _as_list(result)
    if args.group_rm or any(s.status == Sample.Status.ABORTED for s in samples):
        return result
    for s in samples:
        if s.reward is None:  # a custom generate function may have rewarded it already
            s.reward = await async_rm(args, s)
    return result


async def generate_and_rm_group(args, group: list[Sample], sampling_params: dict,
                                evaluation: bool = False) -> list[Sample | list[Sample]]:
    """All samples of one prompt concurrently; with --group-rm the group is rewarded in one call."""
    if getattr(GenerateState(args), "aborted", False):
        return group
    for sample in group:
        if sample.session_id is None:
            sample.session_id = uuid.uuid4().hex
    done = await gather_or_cancel(generate_and_rm(args, s, dict(sampling_params), evaluation) for s in group)
    flat = flatten_groups(done)
    if args.group_rm and not any(s.status == Sample.Status.ABORTED for s in flat):
        for sample, reward in zip(flat, await batched_async_rm(args, flat), strict=True):
            sample.reward = reward
    return done


def concurrency(args) -> int:
    run = run_config_of(args)
    return run.rollout.concurrency_per_engine * max(1, run.roles.engines)


async def generate_groups(args, groups: list[list[Sample]], params: dict, desc: str,
                          evaluation: bool = False) -> list[list[Sample]]:
    """Generate and reward all groups concurrently; results in input order; a tqdm bar per call."""
    with tqdm(total=len(groups), desc=desc, mininterval=5.0) as bar:

        async def one(group: list[Sample]) -> list[Sample]:
            result = await generate_and_rm_group(args, group, params, evaluation)
            bar.update(1)
            return result

        return await gather_or_cancel(one(g) for g in groups)


# ---------------------------------------------------------------- rollout functions

def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """The default `--rollout-function-path`: rollout_batch_size groups (or every eval dataset).

    Groups are drawn --over-sampling-batch-size at a time and kept when --dynamic-sampling-filter-path
    accepts them, until rollout_batch_size are kept; groups still in flight are then aborted and, with
    --partial-rollout, handed back to the data source to be resumed by a later rollout.
    """
    if evaluation:
        return run(eval_rollout(args, rollout_id))
    start = time.monotonic()
    GenerateState(args).reset(rollout_id)
    loop = SamplingLoop(args, rollout_id, generate_group=generate_and_rm_group, state=GenerateState(args),
                        drain_timeout_s=request_timeout(args))
    result = run(loop.run(data_source.get_samples, sampling_params(args)))
    if result.aborted_groups:
        data_source.add_samples(result.aborted_groups)
    kept = result.kept_groups
    _apply_group_hooks(args, kept, result.all_groups, data_source)
    metrics = {**compute_rollout_metrics(args, flatten_groups(kept)), **result.metrics(args)}
    say = logger.info if args.verbose else logger.debug  # else: the driver's rollout line
    say("rollout %d: %d samples in %.1fs, raw reward %.3f, truncated %.2f", rollout_id,
        len(flatten_groups(kept)), time.monotonic() - start, metrics["rollout/raw_reward"],
        metrics["rollout/truncated_ratio"])
    return RolloutFnTrainOutput(samples=kept, metrics=metrics)


def _apply_group_hooks(args, kept: list[list[Sample]], every_group: list[list[Sample]], data_source) -> None:
    """--rollout-sample-filter-path (may set remove_sample), then --rollout-all-samples-process-path."""
    if args.rollout_sample_filter_path:
        load_function(args.rollout_sample_filter_path)(args, kept)
    if args.rollout_all_samples_process_path:
        load_function(args.rollout_all_samples_process_path)(args, every_group, data_source)


_eval_datasets: dict[str, PromptDataset] = {}  # repr(spec) -> dataset, read once per process


def _eval_dataset(args, spec: PromptFileSpec) -> PromptDataset:
    key = repr(spec)
    if key not in _eval_datasets:
        _eval_datasets[key] = PromptDataset(spec, load_tokenizer(args.hf_checkpoint), vision_of(args.hf_checkpoint, spec))
    return _eval_datasets[key]


def _eval_groups(args, dataset: PromptDataset, config: EvalDatasetSpec) -> list[list[Sample]]:
    n = config.n_samples_per_eval_prompt or args.n_samples_per_eval_prompt
    groups = []
    for group_index, prompt in enumerate(dataset.samples):
        group = [copy.deepcopy(prompt) for _ in range(n)]
        for offset, sample in enumerate(group):
            sample.group_index, sample.index = group_index, group_index * n + offset
            sample.metadata = config.sample_metadata(sample.metadata)  # per-dataset rm_type (--eval-config)
        groups.append(group)
    return groups


def _eval_reward(args, sample: Sample) -> float:
    key = args.eval_reward_key or args.reward_key
    return float(sample.reward[key] if key else sample.reward)


async def eval_rollout(args, rollout_id: int) -> RolloutFnEvalOutput:
    """Every eval dataset with the --eval-* sampling settings (and its own, from --eval-config); metrics per
    dataset."""
    GenerateState(args).reset(rollout_id)
    data, metrics = {}, {}
    specs = eval_prompt_specs(args)
    for config in eval_datasets(args):
        name, spec = config.name, specs[config.name]
        params = {**sampling_params(args, evaluation=True), **config.sampling_overrides()}
        groups = _eval_groups(args, _eval_dataset(args, spec), config)
        samples = flatten_groups(await generate_groups(args, groups, params, f"eval {name} @ {rollout_id}",
                                                       evaluation=True))
        rewards = [_eval_reward(args, s) for s in samples]
        data[name] = {
            "rewards": rewards,
            "truncated": [s.status == Sample.Status.TRUNCATED for s in samples],
            "samples": samples,
        }
        metrics.update(compute_eval_metrics(name, samples, rewards))
    return RolloutFnEvalOutput(data=data, metrics=metrics)
