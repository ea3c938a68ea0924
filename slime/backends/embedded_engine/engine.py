"""The embedded rollout engine: a transformers causal LM generating batches on CPU.

Not thread-safe by design: the HTTP server runs every call on one worker thread, so a batch,
a weight update and a release never overlap.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from slime.backends.sglang_utils import weight_delta
from slime.backends.sglang_utils.tensor_digest import tensor_digests
from slime.backends.embedded_engine.sampling import SamplingParams, logprob_temperature, sample_next_tokens
from slime.backends.embedded_engine.vision import load_model, prefill_inputs
from slime.utils.device_memory import sample_device_memory
from slime.models.moe_hf import RouteCapture, encode_routes, fused_engine_target
from slime.models.registry import COMPOSITE_TEXT_PREFIX, family_of
from slime.utils.vision_processor import ProcessedImages

logger = logging.getLogger(__name__)

INITIAL_WEIGHT_VERSION = "default"  # SGLang's initial weight_version
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's tags; a release without tags releases all


class EngineReleasedError(RuntimeError):
    """Raised when generation is asked of an engine whose memory is released (colocate sleep)."""


@dataclass(frozen=True)
class GenerationRequest:
    rid: str
    input_ids: tuple[int, ...]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    """-1: output log-probs only; k >= 0: also the prompt's tokens from position k (SGLang's meaning)."""
    return_routed_experts: bool = False
    """MoE: the experts each token went to, per MoE layer (SGLang's meta_info.routed_experts)."""
    routed_experts_start_len: int = 0
    images: ProcessedImages | None = field(default=None, compare=False)
    """The processed `image_data` of the prompt (a vision + text checkpoint); its image tokens already counted."""


@dataclass
class _RowState:
    request: GenerationRequest
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    trim_chars: int | None = None  # text length kept when a stop string matched
    input_logprobs: list[float | None] | None = None
    routes: list = field(default_factory=list)  # per forward: [positions, MoE layers, top-k] of this row


@dataclass(frozen=True)
class GenerationResult:
    rid: str
    text: str
    output_ids: list[int]
    finish_reason: dict[str, Any]
    prompt_tokens: int
    output_logprobs: list[float] | None
    weight_version: str
    input_logprobs: list[tuple[float | None, int]] | None = None
    routed_experts: str | None = None

    def to_sglang(self) -> dict[str, Any]:
        """The JSON object SGLang's /generate returns for one sequence."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        if self.output_logprobs is not None:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(self.output_logprobs, self.output_ids)]
            meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in self.input_logprobs or ()]
        if self.routed_experts is not None:
            meta["routed_experts"] = self.routed_experts
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


class EmbeddedEngine:
    def __init__(self, model_path: str, *, dtype: str = "float32", seed: int = 0, device: str = "cpu") -> None:
        from transformers import AutoTokenizer, GenerationConfig

        self.model_path = str(model_path)
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        # a vision + text checkpoint: the composite class and its image processing (vision.py)
        model, self.vision = load_model(self.model_path, self.dtype, self.tokenizer)
        self.model = model.to(self.device).eval()
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.weight_version = INITIAL_WEIGHT_VERSION
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer, GenerationConfig, Path(self.model_path))
        text_config = self.model.config.get_text_config()
        self.context_length = int(getattr(text_config, "max_position_embeddings", 4096))
        self._released: set[str] = set()
        self._weights_backup: dict[str, torch.Tensor] | None = None
        # the checkpoint names this engine serves: what it loaded, then every name a push wrote
        self._served_names = set(_checkpoint_names(Path(self.model_path)) or self.model.state_dict())

    # ----- state -----------------------------------------------------------------------
    @property
    def released_tags(self) -> tuple[str, ...]:
        return tuple(sorted(self._released))

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "model_type": getattr(self.model.config, "model_type", None),
            "architectures": getattr(self.model.config, "architectures", None),
            "context_length": self.context_length,
            "released_tags": list(self.released_tags),
        }

    # ----- generation ------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    @torch.no_grad()
    def generate_batch(
        self, requests: list[GenerationRequest], should_abort: Callable[[str], bool] = lambda rid: False
    ) -> list[GenerationResult]:
        if self._released:
            raise EngineReleasedError(
                f"engine memory is released ({', '.join(self.released_tags)}); call /resume_memory_occupation first"
            )
        rows = [self._new_row(r) for r in requests]
        # a prompt-scoring request (max_new_tokens 0 with input log-probs, as a distillation teacher gets)
        # still needs its prefill
        active = [row for row in rows if row.finish_reason is None or row.request.logprob_start_len >= 0]
        # a family whose maths left padding changes (DeepSeek-V4's compression windows) runs one row at a time
        batches = [active] if family_of(self.model.config).batched_generation else [[row] for row in active]
        for batch in batches:
            if batch:
                self._decode(batch, should_abort)
        return [self._result(row) for row in rows]

    def _new_row(self, request: GenerationRequest) -> _RowState:
        prompt_len = len(request.input_ids)
        if prompt_len == 0:
            raise ValueError("empty prompt")
        if prompt_len >= self.context_length:
            raise ValueError(f"prompt of {prompt_len} tokens does not fit the context length {self.context_length}")
        max_new = min(request.params.max_new_tokens, self.context_length - prompt_len)
        row = _RowState(request=request, max_new_tokens=max_new)
        if max_new == 0:
            row.finish_reason = {"type": "length", "length": 0}
        return row

    def _decode(self, rows: list[_RowState], should_abort: Callable[[str], bool]) -> None:
        from transformers import DynamicCache

        input_ids, attention_mask = self._left_pad([list(r.request.input_ids) for r in rows])
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        extra, mrope = {}, None
        if self.vision is not None:  # multimodal RoPE's three rows; the images go in with the prefill
            extra, mrope = prefill_inputs(self.model, self.vision, [r.request.images for r in rows], input_ids,
                                          attention_mask)
            extra = {key: value.to(self.device) for key, value in extra.items()}
            position_ids = extra.pop("position_ids")
        cache = DynamicCache(config=self.model.config)
        params = [r.request.params for r in rows]
        wants_input = any(r.request.logprob_start_len >= 0 for r in rows)
        capture = RouteCapture(self.model) if any(r.request.return_routed_experts for r in rows) else None
        first = True
        while True:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=0 if first and wants_input else 1,
                **{cache_keyword(self.model): cache},
                **(extra if first else {}),
            )
            if capture is not None:
                capture.take(rows, input_ids.shape, attention_mask[:, -input_ids.shape[1]:])
            _check_cache_holds(cache, attention_mask.shape[1])
            if first and wants_input:
                _fill_input_logprobs(rows, out.logits, input_ids)
            first = False
            positions = [len(r.request.input_ids) + len(r.output_ids) for r in rows]
            tokens, logprobs = sample_next_tokens(out.logits[:, -1, :], params, self.generator, positions)
            for i, row in enumerate(rows):
                if row.finish_reason is None:
                    self._append(row, int(tokens[i]), float(logprobs[i]), should_abort)
            if all(r.finish_reason is not None for r in rows):
                if capture is not None:
                    capture.close()
                return
            input_ids = tokens.unsqueeze(1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(input_ids)], dim=1)
            position_ids = mrope.step().to(self.device) if mrope is not None else position_ids[:, -1:] + 1

    def _left_pad(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in sequences)
        pad_id = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, seq in enumerate(sequences):
            ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _append(self, row: _RowState, token: int, logprob: float, should_abort: Callable[[str], bool]) -> None:
        row.output_ids.append(token)
        row.logprobs.append(logprob)
        p = row.request.params
        if should_abort(row.request.rid):
            row.finish_reason = {"type": "abort", "message": "request aborted"}
            return
        past_min = len(row.output_ids) >= p.min_new_tokens
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        if past_min and token in stop_ids:
            row.finish_reason = {"type": "stop", "matched": token}
        elif past_min and p.stop and self._match_stop_string(row):
            return
        elif len(row.output_ids) >= row.max_new_tokens:
            row.finish_reason = {"type": "length", "length": row.max_new_tokens}

    def _match_stop_string(self, row: _RowState) -> bool:
        p = row.request.params
        text = self.tokenizer.decode(row.output_ids, skip_special_tokens=p.skip_special_tokens)
        hits = [(text.find(s), s) for s in p.stop if s and s in text]
        if not hits:
            return False
        position, matched = min(hits)
        row.finish_reason = {"type": "stop", "matched": matched}
        row.trim_chars = position
        return True

    def _result(self, row: _RowState) -> GenerationResult:
        p = row.request.params
        text_ids = row.output_ids
        reason = row.finish_reason or {"type": "length", "length": row.max_new_tokens}
        if reason["type"] == "stop" and isinstance(reason.get("matched"), int) and not p.no_stop_trim:
            text_ids = row.output_ids[:-1]  # SGLang drops the matched stop token from the text
        text = self.tokenizer.decode(text_ids, skip_special_tokens=p.skip_special_tokens)
        if row.trim_chars is not None and not p.no_stop_trim:
            text = text[: row.trim_chars]
        return GenerationResult(
            rid=row.request.rid,
            text=text,
            output_ids=list(row.output_ids),
            finish_reason=reason,
            prompt_tokens=len(row.request.input_ids),
            output_logprobs=list(row.logprobs) if row.request.return_logprob else None,
            weight_version=self.weight_version,
            input_logprobs=self._input_logprobs(row),
            routed_experts=encode_routes(row) if row.request.return_routed_experts else None,
        )

    def _input_logprobs(self, row: _RowState) -> list[tuple[float | None, int]] | None:
        start = row.request.logprob_start_len
        if not row.request.return_logprob or start < 0:
            return None
        prompt = row.request.input_ids
        values = row.input_logprobs or [None] * len(prompt)
        return [(values[k], prompt[k]) for k in range(start, len(prompt))]

    # ----- weights -----------------------------------------------------------------------
    @torch.no_grad()
    def receive_broadcast_weights(self, group, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                  weight_version: str | None) -> int:
        """SGLang's distributed update: allocate each tensor, receive it from the group's rank 0 in order, load all."""
        if "weights" in self._released:
            raise EngineReleasedError("weights are released; call /resume_memory_occupation before updating them")
        received = []
        device = self.device if group.spec.backend == "nccl" else torch.device("cpu")  # gloo moves host tensors
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty([int(d) for d in shape], dtype=_torch_dtype(dtype), device=device)
            group.broadcast(tensor, 0)
            received.append((name, tensor))
        return self.update_weights(received, weight_version)

    @torch.no_grad()
    def receive_broadcast_delta(self, group, specs: list[dict], encoding: str, checksum: str,
                                weight_version: str | None) -> tuple[int, list[str]]:
        """A delta push (sglang_utils/weight_delta.py): receive every changed tensor's positions and values
        from rank 0 in order, apply them to copies, check each result's digest; load only if all match.
        Returns (tensors loaded, names whose digest differs: then nothing was loaded)."""
        if "weights" in self._released:
            raise EngineReleasedError("weights are released; call /resume_memory_occupation before updating them")
        device = self.device if group.spec.backend == "nccl" else torch.device("cpu")
        received = []
        for spec in specs:  # every broadcast is consumed, whatever the verdict: the group stays in step
            dtype, changed = _torch_dtype(spec["dtype"]), int(spec["changed"])
            numel = math.prod(int(d) for d in spec["shape"])
            positions = torch.empty(changed, dtype=weight_delta.index_dtype(numel), device=device)
            values = torch.empty(changed * dtype.itemsize, dtype=torch.uint8, device=device)
            if changed:
                group.broadcast(positions, 0)
                group.broadcast(values, 0)
            received.append((spec, dtype, positions, values.view(weight_delta.value_dtype(dtype))))
        updated, mismatched = [], []
        for spec, dtype, positions, values in received:
            current = self.get_weight(spec["name"]).to(dtype)
            if list(current.shape) != [int(d) for d in spec["shape"]]:
                raise ValueError(f"delta for {spec['name']!r} of shape {spec['shape']}, the engine's is "
                                 f"{list(current.shape)}")
            new = weight_delta.apply(current, positions, values, encoding) if len(positions) else current
            if weight_delta.digest(new, checksum) != spec["digest"]:
                mismatched.append(spec["name"])
            elif len(positions):
                updated.append((spec["name"], new))
        if mismatched:
            return 0, mismatched
        return self.update_weights(updated, weight_version), []

    @torch.no_grad()
    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], weight_version: str | None, *,
                       adopt: bool = False, empty_cache: bool = False) -> int:
        """Load the named tensors (HF parameter names) into the model; all-or-nothing.

        adopt: the tensors are read-only views of a host-shared mapping that outlives this call; a
        parameter of the same dtype and device then uses them as its storage (no copy, one copy of the
        weights per host however many engines map it). Anything else is copied, and on CUDA the copies
        have finished when this returns (a CUDA-IPC sender reuses its memory once answered).
        empty_cache: give the allocator's cached blocks back afterwards (SGLang's torch_empty_cache)."""
        if "weights" in self._released:
            raise EngineReleasedError("weights are released; call /resume_memory_occupation before updating them")
        state = self.model.state_dict()
        targets = {name: checkpoint_target(name, state, self.model.config) for name, _ in named_tensors}
        problems = [_check_tensor(name, tensor, targets[name]) for name, tensor in named_tensors]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError("weight update rejected: " + "; ".join(problems[:5]))
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied names share one Parameter
        for name, tensor in named_tensors:
            param = params.get(name)
            if adopt and param is not None and tensor.dtype == param.dtype and tensor.device == param.device \
                    and targets[name].shape == param.shape and targets[name].stride() == param.stride():
                param.data = tensor
            else:
                targets[name].copy_(tensor.to(targets[name].dtype))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if empty_cache:
                torch.cuda.empty_cache()
        if weight_version is not None:
            self.weight_version = str(weight_version)
        self._served_names.update(name for name, _ in named_tensors)
        return len(named_tensors)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None) -> int:
        fresh, _ = load_model(model_path, self.dtype, self.tokenizer)
        state = fresh.state_dict()  # each tensor as its name's checkpoint layout (a family's view, as a push's)
        count = self.update_weights([(name, checkpoint_target(name, state, fresh.config)) for name in state],
                                    weight_version)
        self.model_path = str(model_path)
        self._served_names = set(_checkpoint_names(Path(model_path)) or fresh.state_dict())
        return count

    def get_weight(self, name: str) -> torch.Tensor:
        if "weights" in self._released:
            raise EngineReleasedError("weights are released")
        target = checkpoint_target(name, self.model.state_dict(), self.model.config)
        if target is None:
            raise KeyError(f"unknown parameter {name!r}")
        return target.detach().clone()

    def served_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter and persistent buffer the model holds, once: under the checkpoint names it was loaded
        or pushed under (views into transformers' fused tensors included), then, under transformers' own name,
        any tensor (or fused tensor) that no such name covers entirely."""
        if "weights" in self._released:
            raise EngineReleasedError("weights are released")
        state = self.model.state_dict()
        served = [(name, target) for name in sorted(self._served_names)
                  if (target := checkpoint_target(name, state, self.model.config)) is not None]
        covered: dict[int, set[tuple]] = {}
        for _, target in served:
            covered.setdefault(target.untyped_storage().data_ptr(), set()).add(
                (target.storage_offset(), tuple(target.shape), tuple(target.stride())))
        for name, tensor in state.items():
            views = covered.get(tensor.untyped_storage().data_ptr(), set())
            if sum(math.prod(shape) for _, shape, _ in views) < tensor.numel():
                served.append((name, tensor))
                covered.setdefault(tensor.untyped_storage().data_ptr(), set()).add(
                    (tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())))
        return served

    @torch.no_grad()
    def weight_checksums(self) -> dict[str, str]:
        """name -> digest (sglang_utils/tensor_digest.py) of every served tensor, in the dtype the engine holds it."""
        served = self.served_tensors()
        return dict(zip((name for name, _ in served), tensor_digests([tensor for _, tensor in served])))

    # ----- colocate sleep/wake -----------------------------------------------------------
    def release(self, tags: list[str] | None) -> None:
        """Mirror SGLang's release: weights leave the device for a host backup (SGLang keeps a CPU
        weight backup too), no KV state survives, and the device memory goes back to the driver so
        a colocated trainer can use it; generation then fails clearly until resumed."""
        tags = _check_tags(tags)
        if "weights" in tags and "weights" not in self._released:
            self._weights_backup = {name: param.detach().to("cpu", copy=True)
                                    for name, param in self.model.named_parameters()}
            for param in self.model.parameters():
                param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        self._released |= set(tags)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self, tags: list[str] | None) -> None:
        tags = _check_tags(tags)
        if "weights" in tags and "weights" in self._released:
            assert self._weights_backup is not None
            for name, param in self.model.named_parameters():
                param.data = self._weights_backup[name].to(self.device)
            self._weights_backup = None
        self._released -= set(tags)
        if not self._released and self.device.type == "cuda":  # the awake period's peak starts here
            torch.cuda.reset_peak_memory_stats(self.device)

    def memory(self) -> dict[str, float]:
        """This engine's device memory in GiB (zeros on CPU), for the colocate metrics."""
        return sample_device_memory(self.device).gigabytes()


def cache_keyword(model) -> str:
    """The name under which `model.forward` takes its KV cache: transformers renamed `past_key_values`
    to `cache` (5.24 has `cache`, the GPU machines' 5.17 only `past_key_values`). Passing the other name
    is not an error there: it lands in **kwargs, and every decode step then sees its new token alone."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`")


def _check_cache_holds(cache, tokens: int) -> None:
    """Every decode step must extend the engine's cache to all tokens fed so far; otherwise the
    model decoded without its context and the log-probs it reported are not the policy's."""
    held = cache.get_seq_length()
    if held != tokens:
        raise RuntimeError(f"the KV cache holds {held} tokens after a step over {tokens}: this transformers "
                           "version did not use the engine's cache")


def _fill_input_logprobs(rows: list[_RowState], logits: torch.Tensor, input_ids: torch.Tensor) -> None:
    """Log-prob of each prompt token given the tokens before it (left-padded batch; the first has none), at the
    request's temperature like the output log-probs (logprob_temperature): a teacher scoring a student's
    rollout (on-policy distillation) scores it at the temperature the student sampled with."""
    width = input_ids.shape[1]
    for i, row in enumerate(rows):
        if row.request.logprob_start_len < 0:
            continue
        n = len(row.request.input_ids)
        offset = width - n
        scaled = logits[i, offset : width - 1].float() / logprob_temperature(row.request.params)
        logprobs = torch.log_softmax(scaled, dim=-1)
        targets = input_ids[i, offset + 1 : width].unsqueeze(1)
        row.input_logprobs = [None, *logprobs.gather(1, targets).squeeze(1).tolist()]


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _check_tags(tags: list[str] | None) -> list[str]:
    tags = list(tags) if tags else list(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
    return tags


def checkpoint_target(name: str, state: dict[str, torch.Tensor], config: Any) -> torch.Tensor | None:
    """The model tensor (or view of one) a checkpoint-named tensor loads into; None if the model has none.

    Pushes speak checkpoint names, as SGLang's loader does; transformers keeps MoE experts fused in memory
    (slime/models/moe_hf.py says where each expert's rows live, and MiniMax-M2's block_sparse_moe is `mlp`), and
    serves a composite (vision + text) checkpoint through its text model (AutoModelForCausalLM), whose names lack
    `language_model.`, or, with images, through the composite class, whose text tensors keep them. A family that
    keeps a checkpoint tensor elsewhere or otherwise laid out in memory says where first (`in_memory_target`)."""
    family = family_of(config)
    own = family.in_memory_target(name, state.keys(), config) if family.in_memory_target is not None else None
    if own is not None:
        target, view = own
        return view(state[target]) if callable(view) else state[target][view]
    if name in state:
        return state[name]
    if name.startswith(COMPOSITE_TEXT_PREFIX):  # a composite checkpoint's text weights
        text_name = "model." + name[len(COMPOSITE_TEXT_PREFIX):]
        if not any(key.startswith(COMPOSITE_TEXT_PREFIX) for key in state):  # the engine runs the text model
            return checkpoint_target(text_name, state, config)
        # the composite class (images): its text model's tensors under their text-model names
        text_state = {"model." + key[len(COMPOSITE_TEXT_PREFIX):]: value for key, value in state.items()
                      if key.startswith(COMPOSITE_TEXT_PREFIX)}
        return checkpoint_target(text_name, text_state, config.get_text_config())
    if any(key.startswith(COMPOSITE_TEXT_PREFIX) for key in state):  # Qwen2-VL's layout: `model.X`, `visual.X`
        if name.startswith("visual."):
            return checkpoint_target("model." + name, state, config)
        if name.startswith("model.") and not name.startswith("model.visual."):
            return checkpoint_target(COMPOSITE_TEXT_PREFIX + name[len("model."):], state, config)
    fused = fused_engine_target(name, set(state), family.moe(config))
    if fused is None or fused[0] not in state:
        renamed = _renamed(name, getattr(config, "model_type", None))
        return state.get(renamed) if renamed != name else None
    target, expert, rows = fused
    if expert is None:
        return state[target]
    return state[target][expert, rows] if expert < state[target].shape[0] else None


def _renamed(name: str, model_type: str | None) -> str:
    """A checkpoint name as transformers' own renaming rules of the model type put it in memory (DeepSeek-V4's
    checkpoints spell `attn.wq_a` what its model holds as `self_attn.q_a_proj`); the name itself without rules."""
    renamings = _renamings(model_type)
    if not renamings:
        return name
    from transformers.core_model_loading import apply_renamings

    return apply_renamings(name, renamings)


@functools.lru_cache(maxsize=None)
def _renamings(model_type: str | None) -> tuple:
    if not model_type:
        return ()
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # a transformers without conversion rules loads checkpoints by their names
        return ()
    return tuple(t for t in get_checkpoint_conversion_mapping(model_type) or () if isinstance(t, WeightRenaming))


def _check_tensor(name: str, tensor: torch.Tensor, target: torch.Tensor | None) -> str | None:
    if target is None:
        return f"unknown parameter {name!r}"
    if tuple(tensor.shape) != tuple(target.shape):
        return f"{name}: shape {tuple(tensor.shape)} != {tuple(target.shape)}"
    return None


def _checkpoint_names(model_path: Path) -> list[str]:
    """The tensor names of a safetensors checkpoint (headers only); none for another format."""
    from safetensors import safe_open

    names: list[str] = []
    for path in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def _eos_ids(model, tokenizer, generation_config_cls, model_path: Path) -> tuple[int, ...]:
    ids: set[int] = set()
    if (model_path / "generation_config.json").is_file():
        eos = generation_config_cls.from_pretrained(str(model_path)).eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    for candidate in (getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
        ids |= set(candidate if isinstance(candidate, list) else [candidate] if candidate is not None else [])
    return tuple(sorted(ids))
