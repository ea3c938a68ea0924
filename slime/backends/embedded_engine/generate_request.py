"""The /generate body as SGLang reads it, turned into the embedded engine's requests.

SGLang's rules, mirrored: a top-level key SGLang does not know is ignored (the real sglang-router
adds `model`, for instance); a key SGLang knows is honoured here, or has no effect on a single CPU
engine (logging, tracing, routing metadata), or is refused unless it carries its neutral value, so
a request never silently gets something other than what it asked for. `sampling_params` keys are
checked by SamplingParams (unknown keys refused, integers where SGLang wants integers).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Callable

from slime.backends.embedded_engine.engine import GenerationRequest
from slime.backends.embedded_engine.sampling import SamplingParams
from slime.backends.embedded_engine.vision import request_images

logger = logging.getLogger(__name__)

HONOURED_KEYS = frozenset({
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "return_text_in_logprobs",
    "return_routed_experts", "routed_experts_start_len", "image_data",
})
# Metadata for logging, tracing, routing and scheduling across many workers: nothing to do on one CPU engine.
NO_EFFECT_KEYS = frozenset({
    "log_metrics", "no_logs", "custom_labels", "external_trace_header", "received_time", "routing_key",
    "conversation_id", "priority", "extra_key", "http_worker_ipc", "data_parallel_rank", "routed_dp_rank",
    "disagg_prefill_dp_rank", "cache_salt", "kv_hints",
})
# Every other GenerateReqInput field of the supported SGLang range: accepted only at its neutral value.
NEUTRAL_ONLY_KEYS: dict[str, Any] = {
    **{key: None for key in (
        "session_id", "input_embeds", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
        "video_config", "watermark", "top_logprobs_num", "token_ids_logprob", "return_sampling_mask",
        "sampling_logprobs_mode", "modalities", "session_params", "lora_path", "lora_id", "custom_logit_processor",
        "positional_embed_overrides", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
        "decode_tp_size", "max_thinking_tokens", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
        "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch",
        "images_config", "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool",
        "mm_data_mooncake",
    )},
    **{key: False for key in (
        "use_audio_in_video", "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs", "stream",
        "return_hidden_states", "return_indexer_topk", "background", "require_reasoning",
        "return_bytes", "return_entropy", "return_prompt_token_ids", "return_flat_raw_top_logprobs_b64",
    )},
}
KNOWN_KEYS = HONOURED_KEYS | NO_EFFECT_KEYS | frozenset(NEUTRAL_ONLY_KEYS)


def check_top_level_keys(body: dict[str, Any]) -> None:
    for key, neutral in NEUTRAL_ONLY_KEYS.items():
        value = body.get(key, neutral)
        if value != neutral and value not in (None, False, 0, [], {}):
            raise ValueError(f"/generate field {key}={value!r} is not supported by the embedded engine")
    ignored = sorted(set(body) - KNOWN_KEYS)
    if ignored:  # as SGLang does: keys it does not know are dropped
        logger.debug("ignoring /generate keys SGLang does not know: %s", ignored)


def build_requests(body: dict[str, Any], tokenize: Callable[[str], list[int]],
                   vision=None) -> tuple[list[GenerationRequest], bool]:
    """Requests in order, and whether the reply is a list (a batch, or n > 1). `vision`: the engine's
    VisionProcessor (a vision + text checkpoint), which takes `image_data`."""
    check_top_level_keys(body)
    prompts, is_batch = _prompts(body, tokenize)
    images = [_with_images(vision, prompt, uris)
              for prompt, uris in zip(prompts, request_images(body.get("image_data"), len(prompts), is_batch))]
    prompts = [prompt for prompt, _ in images]
    params = SamplingParams.from_request(body.get("sampling_params"))
    rids = body.get("rid")
    rid_list = rids if isinstance(rids, list) else [rids] * len(prompts)
    if len(rid_list) != len(prompts):
        raise ValueError(f"rid has {len(rid_list)} entries for {len(prompts)} prompts")
    start = _logprob_start_len(body.get("logprob_start_len"))
    return_logprob = bool(body.get("return_logprob") or False)
    routes = dict(return_routed_experts=bool(body.get("return_routed_experts") or False),
                  routed_experts_start_len=int(body.get("routed_experts_start_len") or 0))
    requests = []
    for (prompt, processed), rid in zip(images, rid_list):
        base = rid or uuid.uuid4().hex
        if return_logprob and start >= len(prompt):
            raise ValueError(f"logprob_start_len {start} is not inside the prompt of {len(prompt)} tokens")
        for k in range(params.n):
            requests.append(GenerationRequest(
                rid=base if params.n == 1 else f"{base}-{k}", input_ids=tuple(prompt), params=params,
                return_logprob=return_logprob, logprob_start_len=start if return_logprob else -1, **routes,
                images=processed,
            ))
    return requests, is_batch or params.n > 1


def _with_images(vision, prompt: list[int], uris: list[str] | None):
    """(prompt ids with each image's run of image tokens at its processed count, processed images)."""
    if not uris:
        return prompt, None
    if vision is None:
        raise ValueError("image_data was sent, but the engine's checkpoint has no vision tower and image processor")
    processed = vision.process(uris)
    return vision.expand_runs(prompt, processed), processed


def _prompts(body: dict[str, Any], tokenize: Callable[[str], list[int]]) -> tuple[list[list[int]], bool]:
    if (body.get("text") is None) == (body.get("input_ids") is None):
        raise ValueError("exactly one of text or input_ids is required")
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        is_batch = bool(ids) and isinstance(ids[0], list)
        rows = ids if is_batch else [ids]
        return [[_token_id(t) for t in row] for row in rows], is_batch
    text = body["text"]
    is_batch = isinstance(text, list)
    return [tokenize(t) for t in (text if is_batch else [text])], is_batch


def _token_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"input_ids must hold integers, got {value!r}")
    return value


def _logprob_start_len(value: Any) -> int:
    """SGLang: None or -1 means log-probs of output tokens only; k >= 0 adds prompt tokens from position k."""
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"logprob_start_len must be an integer >= -1, got {value!r}")
    return value
