"""Prompt data: read --prompt-data, turn rows into Samples, hand out groups epoch after epoch.

Bad input fails here, at load time, with the flag, file and line in the message; prompts that
cannot fit the engine's context are skipped and counted instead of failing deep inside generation.
"""
from __future__ import annotations

import copy
import functools
import json
import logging
import os
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from slime.rollout import prompt_rows
from slime.rollout.eval_config import EvalDatasetSpec
from slime.rollout.prompt_media import MediaKeys, image_messages, parse_media_keys, row_images
from slime.rollout.plugin_args import flag
from slime.checkpoint import rng
from slime.checkpoint.contents import DATA_ITEMS, data_file
from slime.checkpoint.durable import write_atomic
from slime.utils.processing_utils import check_tokenizer_files
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

_SKIP_EXAMPLES = 5  # line numbers of skipped prompts quoted in the log


@dataclass(frozen=True)
class PromptFileSpec:
    """How to read one prompt file (training or one eval dataset)."""

    path: str
    flag: str  # the flag that named the file, for error messages
    input_key: str = "input"
    label_key: str | None = None
    metadata_key: str | None = "metadata"
    tool_key: str | None = "tools"  # tool specs handed to the chat template when a row has them
    apply_chat_template: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)
    # prompts with more tokens than this are skipped and counted; None: no limit
    max_prompt_len: PromptBudget | None = None
    # --multimodal-keys: the row key holding each prompt's images; None: text prompts
    media_keys: MediaKeys | None = None


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    """The HF tokenizer of --hf-checkpoint, read from local files only (no hub access)."""
    from transformers import AutoTokenizer

    if not path or not os.path.isdir(path):
        raise FileNotFoundError(f"--hf-checkpoint {path!r} is not a directory holding a tokenizer")
    check_tokenizer_files(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=True, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--hf-checkpoint {path}: its tokenizer files cannot be read ({exc}); copy "
                         "tokenizer.json and tokenizer_config.json from the model's HF repository") from exc


def vision_of(hf_checkpoint: str, spec: PromptFileSpec):
    """The checkpoint's VisionProcessor when the prompts carry images (None for text prompts)."""
    if spec.media_keys is None:
        return None
    from slime.utils.vision_processor import load_vision_processor

    return load_vision_processor(hf_checkpoint, load_tokenizer(hf_checkpoint))


def _chat_template_kwargs(args) -> dict:
    """--apply-chat-template-kwargs: a dict, or JSON text; None (arguments built by hand, upstream-style): none."""
    value = args.apply_chat_template_kwargs
    if value is None:
        return {}
    return json.loads(value) if isinstance(value, str) else dict(value)


@dataclass(frozen=True)
class PromptBudget:
    """The longest prompt (tokens) worth sending, and the limit that sets it (for the skip warning)."""

    tokens: int
    reason: str


def context_budget(args) -> PromptBudget | None:
    """The tightest of: --rollout-max-prompt-len (else the context minus one token to generate) and,
    with dynamic batching, the training token budget of a micro-batch minus one response token."""
    budgets = []
    if args.rollout_max_prompt_len:
        budgets.append(PromptBudget(int(args.rollout_max_prompt_len), "--rollout-max-prompt-len"))
    else:
        context = args.rollout_max_context_len
        if context:
            budgets.append(PromptBudget(int(context) - 1, f"--rollout-max-context-len {context} less one token"))
        elif _model_context(args.hf_checkpoint):
            context = _model_context(args.hf_checkpoint)
            budgets.append(PromptBudget(int(context) - 1, f"the model's context ({context}) less one token"))
    if args.use_dynamic_batch_size and args.max_tokens_per_gpu:
        cp = args.context_parallel_size
        budgets.append(PromptBudget(int(args.max_tokens_per_gpu) * cp - 1,
                                    f"the training token budget (--max-tokens-per-gpu {args.max_tokens_per_gpu} x "
                                    f"CP {cp}) less one response token"))
    return min(budgets, key=lambda b: b.tokens, default=None)


def _model_context(hf_checkpoint: str | None) -> int | None:
    config = Path(hf_checkpoint or "") / "config.json"
    if not hf_checkpoint or not config.is_file():
        return None
    return json.loads(config.read_text()).get("max_position_embeddings")


def train_prompt_spec(args) -> PromptFileSpec:
    return PromptFileSpec(
        path=args.prompt_data,
        flag="--prompt-data",
        input_key=args.input_key,
        label_key=args.label_key,
        metadata_key=args.metadata_key,
        tool_key=args.tool_key,
        apply_chat_template=bool(args.apply_chat_template),
        chat_template_kwargs=_chat_template_kwargs(args),
        max_prompt_len=context_budget(args),
        media_keys=parse_media_keys(flag(args, "multimodal_keys")),
    )


def eval_datasets(args) -> tuple[EvalDatasetSpec, ...]:
    """The eval datasets parse_args resolved (--eval-config or --eval-prompt-data)."""
    return tuple(args.eval_datasets)


def eval_prompt_specs(args) -> dict[str, PromptFileSpec]:
    """{name: spec} of every eval dataset; its keys default to the --eval-* ones, then to training's."""
    base = _eval_spec_fields(args)
    flag = "--eval-config" if args.eval_config else "--eval-prompt-data"
    specs = {}
    for dataset in eval_datasets(args):
        keys = {key: getattr(dataset, key) for key in ("input_key", "label_key", "tool_key", "metadata_key")
                if getattr(dataset, key) is not None}
        if dataset.multimodal_keys is not None:
            keys["media_keys"] = parse_media_keys(dataset.multimodal_keys, f"{flag} {dataset.name}: multimodal_keys")
        specs[dataset.name] = PromptFileSpec(path=dataset.path, flag=f"{flag} {dataset.name}", **{**base, **keys})
    return specs


def _eval_spec_fields(args) -> dict[str, Any]:
    return dict(
        input_key=args.eval_input_key or args.input_key,
        label_key=args.eval_label_key or args.label_key,
        metadata_key=args.metadata_key,
        tool_key=args.eval_tool_key or args.tool_key,
        apply_chat_template=bool(args.apply_chat_template),
        chat_template_kwargs=_chat_template_kwargs(args),
        max_prompt_len=args.eval_max_prompt_len or context_budget(args),
        media_keys=parse_media_keys(flag(args, "multimodal_keys")),
    )


def read_rows(spec: PromptFileSpec) -> Iterator[tuple[int, dict]]:
    """(line number, row dict) of a JSONL (or parquet) prompt file."""
    return prompt_rows.read_rows(spec.path, spec.flag)


def _tools(spec: PromptFileSpec, row: dict):
    if not spec.tool_key or row.get(spec.tool_key) is None:
        return None
    tools = row[spec.tool_key]
    return json.loads(tools) if isinstance(tools, str) else tools


def _prompt(spec: PromptFileSpec, row: dict, where: str, tokenizer, images: list[str]) -> str | list[dict]:
    """The prompt text; without --apply-chat-template a chat stays a list of messages (upstream keeps it so:
    SFT renders it turn by turn, and generation refuses it). With --multimodal-keys each `<image>` of the text
    becomes an image item the chat template renders as the model's image placeholder."""
    raw = row[spec.input_key]
    if spec.media_keys is not None:
        if not spec.apply_chat_template:
            raise ValueError(f"{where}: --multimodal-keys needs --apply-chat-template (the chat template writes "
                             "each image's placeholder tokens)")
        raw = image_messages(raw, len(images), where)
    if spec.apply_chat_template:
        messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
        kwargs = dict(spec.chat_template_kwargs)
        if _tools(spec, row) is not None:
            kwargs["tools"] = _tools(spec, row)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    if isinstance(raw, (list, tuple)) and all(isinstance(m, dict) for m in raw):
        return list(raw)
    if not isinstance(raw, str):
        raise ValueError(f"{where}: {spec.input_key!r} holds a {type(raw).__name__}, expected text or chat messages")
    return raw


def _images(spec: PromptFileSpec, row: dict, where: str) -> list[str]:
    if spec.media_keys is None:
        return []
    return row_images(row, spec.media_keys, where, Path(spec.path).resolve().parent)


def _metadata(spec: PromptFileSpec, row: dict, where: str) -> dict:
    value = row.get(spec.metadata_key) if spec.metadata_key else None
    if value is None:
        return {}
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError(f"{where}: metadata key {spec.metadata_key!r} must hold an object")
    return value


def row_to_sample(spec: PromptFileSpec, row: dict, lineno: int, tokenizer, vision=None) -> Sample:
    """One prompt row -> a Sample holding the prompt text, its tokens (each image's tokens expanded, by `vision`,
    the checkpoint's VisionProcessor), its images (multimodal_inputs["images"], data URIs), label and metadata."""
    where = f"{spec.flag}: {spec.path}:{lineno}"
    for key, key_flag in ((spec.input_key, "--input-key"), (spec.label_key, "--label-key")):
        if key is not None and key not in row:
            raise ValueError(prompt_rows.missing_key_message(spec.flag, f"{spec.path}:{lineno}", row, key, key_flag))
    images = _images(spec, row, where)
    prompt = _prompt(spec, row, where, tokenizer, images)
    metadata = _metadata(spec, row, where)
    if isinstance(prompt, list) and _tools(spec, row) is not None:
        metadata.setdefault("tools", _tools(spec, row))  # the chat is rendered later, with its tools
    return Sample(
        prompt=prompt,
        # a chat has no tokens until it is rendered (sft_rollout) or refused (generate)
        tokens=_prompt_tokens(prompt, images, tokenizer, vision, where),
        multimodal_inputs={"images": images} if images else None,
        label=row[spec.label_key] if spec.label_key is not None else None,
        metadata=metadata,
    )


def _prompt_tokens(prompt, images: list[str], tokenizer, vision, where: str) -> list[int]:
    if not isinstance(prompt, str):
        return []
    if not images:
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if vision is None:
        raise ValueError(f"{where}: the row has images, but --hf-checkpoint has no image processor "
                         "(preprocessor_config.json) and vision tower (config.json's vision_config)")
    try:
        return vision.prompt_ids(prompt, images)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


class PromptDataset:
    """All usable prompts of one file, as Samples in file order; over-long prompts skipped and counted."""

    def __init__(self, spec: PromptFileSpec, tokenizer, vision=None):
        self.spec = spec
        self.samples: list[Sample] = []
        self.skipped_lines: list[int] = []
        budget = spec.max_prompt_len
        for lineno, row in read_rows(spec):
            sample = row_to_sample(spec, row, lineno, tokenizer, vision)
            if budget is not None and len(sample.tokens) > budget.tokens:
                self.skipped_lines.append(lineno)
                continue
            self.samples.append(sample)
        self._report(spec)

    def _report(self, spec: PromptFileSpec) -> None:
        skipped, budget = self.skipped_lines, spec.max_prompt_len
        if skipped:
            logger.warning(
                "%s: skipped %d prompt(s) longer than %d tokens, %s (lines %s%s); raise that limit or shorten them",
                spec.path, len(skipped), budget.tokens, budget.reason, skipped[:_SKIP_EXAMPLES],
                " ..." if len(skipped) > _SKIP_EXAMPLES else "",
            )
        if self.samples:
            return
        if skipped:
            raise ValueError(f"{spec.flag}: all {len(skipped)} prompts of {spec.path} are longer than {budget.tokens} "
                             f"tokens, {budget.reason}; raise that limit or shorten the prompts")
        raise ValueError(f"{spec.flag}: {spec.path} is empty: expected one JSON object per line with the prompt "
                         f"under {spec.input_key!r} (--input-key)")

    @property
    def num_skipped(self) -> int:
        return len(self.skipped_lines)

    def __len__(self) -> int:
        return len(self.samples)


def epoch_order(num_prompts: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """Prompt order of one epoch: file order, or a permutation fixed by (seed, epoch)."""
    order = list(range(num_prompts))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


class RolloutDataSource:
    """Hands out `num_prompts` groups of `n_samples_per_prompt` Samples; wraps around epochs.

    A background generator (slime/rollout/fully_async_rollout.py) draws on the rollout loop's thread while the
    manager's thread saves: both hold `lock`. The groups such a generator drew but the trainer has not trained
    yet (`track_outstanding`) are saved with the position and handed out first after a resume, as drawn.
    """

    def __init__(self, args):
        self.args = args
        self.lock = threading.RLock()
        self._outstanding: Callable[[], list[list[Sample]]] = list
        self._returned: list[list[Sample]] = []  # outstanding groups of the saved run, handed out first
        self.epoch_id = 0
        self.sample_offset = 0  # position inside the current epoch's order
        self.sample_group_index = 0
        self.sample_index = 0
        self.metadata: dict = {}
        self.dataset: PromptDataset | None = None
        # --disable-rollout-global-dataset: the rollout function brings its own prompts
        if flag(args, "rollout_global_dataset") and flag(args, "prompt_data") is not None:
            spec = train_prompt_spec(args)
            self.dataset = PromptDataset(spec, load_tokenizer(args.hf_checkpoint), vision_of(args.hf_checkpoint, spec))
        seed = flag(args, "rollout_seed")
        self._seed = int(seed if seed is not None else flag(args, "seed"))
        self._shuffle = bool(flag(args, "rollout_shuffle"))
        self._order: tuple[int, list[int]] | None = None  # (epoch, order) cache

    def _epoch_order(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch_id:
            self._order = (self.epoch_id, epoch_order(len(self.dataset), self.epoch_id, self._seed, self._shuffle))
        return self._order[1]

    def _next_prompts(self, num_prompts: int) -> list[Sample]:
        if self.dataset is None:
            return [Sample() for _ in range(num_prompts)]
        prompts: list[Sample] = []
        size = len(self.dataset)
        while len(prompts) < num_prompts:
            if self.sample_offset == size:
                self.epoch_id += 1
                self.sample_offset = 0
            order = self._epoch_order()
            take = min(num_prompts - len(prompts), size - self.sample_offset)
            prompts += [self.dataset.samples[i] for i in order[self.sample_offset : self.sample_offset + take]]
            self.sample_offset += take
        return prompts

    def track_outstanding(self, groups: Callable[[], list[list[Sample]]]) -> None:
        """`groups()` (called under `lock`): the groups drawn from here that are not trained yet, as drawn."""
        self._outstanding = groups

    def get_samples(self, num_prompts: int) -> list[list[Sample]]:
        """`num_prompts` groups, each n_samples_per_prompt fresh copies with group_index / index set."""
        with self.lock:
            groups = self._returned[:num_prompts]
            del self._returned[:num_prompts]
            return groups + self._fresh_groups(num_prompts - len(groups))

    def _fresh_groups(self, num_prompts: int) -> list[list[Sample]]:
        groups = []
        for prompt in self._next_prompts(num_prompts):
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                sample = copy.deepcopy(prompt)
                sample.group_index, sample.index = self.sample_group_index, self.sample_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Sample]]) -> None:
        raise RuntimeError(f"{type(self).__name__} is read-only; use RolloutDataSourceWithBuffer")

    def state_dict(self) -> dict[str, Any]:
        """Everything the next rollout's prompts depend on (slime/checkpoint/contents.py, DATA_ITEMS): the
        position, the epoch's shuffle order, the partial-rollout buffer, the groups drawn but not trained yet
        and this process's RNG; taken at one instant (under `lock`)."""
        with self.lock:
            outstanding = [*self._returned, *self._outstanding()]
            return {
                "epoch_id": self.epoch_id,
                "sample_offset": self.sample_offset,
                "sample_group_index": self.sample_group_index,
                "sample_index": self.sample_index,
                "metadata": self.metadata,
                "epoch_order": list(self._epoch_order()) if self.dataset is not None else [],
                "buffer": self._buffer_state(),
                "outstanding": [[sample.to_dict() for sample in group] for group in outstanding],
                "rng": rng.capture(tracker=False),
            }

    def _buffer_state(self) -> list[list[dict]]:
        return []

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, default in (("epoch_id", 0), ("sample_offset", 0), ("sample_group_index", 0), ("sample_index", 0)):
            setattr(self, key, int(state.get(key, default)))
        self.metadata = dict(state.get("metadata", {}))
        missing = [key for key in DATA_ITEMS if key not in state]
        if missing:
            logger.warning("the data-source state has no %s (written before they were saved): the resumed run's "
                           "prompts and sampling may differ from the saved run's", missing)
        if state.get("epoch_order") and self.dataset is not None:
            self._order = (self.epoch_id, self._checked_order(state["epoch_order"]))
        self._load_buffer(state.get("buffer") or [])
        self._returned = [[Sample.from_dict(sample) for sample in group] for group in state.get("outstanding") or []]
        if state.get("rng") is not None:
            rng.restore(state["rng"])

    def _checked_order(self, order: list[int]) -> list[int]:
        if sorted(order) != list(range(len(self.dataset))):
            raise ValueError(f"--prompt-data {self.dataset.spec.path} has {len(self.dataset)} usable prompts, but the "
                             f"saved data position is for {len(order)}: resume with the prompt file (and prompt "
                             "length limits) the run was saved with")
        return [int(i) for i in order]

    def _load_buffer(self, groups: list[list[dict]]) -> None:
        if groups:
            raise ValueError(f"the saved data state holds {len(groups)} partial-rollout groups, but "
                             f"{type(self).__name__} has no buffer; resume with the --data-source-path it was saved with")

    @staticmethod
    def state_path(root: str, rollout_id: int) -> str:
        return data_file(root, rollout_id)

    def save(self, rollout_id: int) -> None:
        """Write the data state under --save (atomically, fsynced), so --load resumes with the next prompts."""
        if not self.args.save:
            return
        state = self.state_dict()
        write_atomic(self.state_path(self.args.save, rollout_id), lambda handle: torch.save(state, handle))

    def load(self, rollout_id: int | None = None) -> None:
        """The state saved after rollout `rollout_id` under --load; a missing file is an error unless
        --allow-fresh-data-position accepts starting from the first prompt."""
        if not self.args.load or rollout_id is None:
            return
        path = self.state_path(self.args.load, rollout_id)
        if saved_data_position(self.args, rollout_id):
            self.load_state_dict(torch.load(path, weights_only=True))
        else:
            logger.warning("no data-source state at %s: starting from the first prompt (--allow-fresh-data-position)",
                           path)

    def __len__(self) -> int:
        return len(self.dataset) if self.dataset is not None else 0


def saved_data_position(args, rollout_id: int) -> bool:
    """Whether --load holds the data state saved after `rollout_id`. Missing: an error naming the file, unless
    --allow-fresh-data-position accepts starting from the first prompt (then False). The driver asks before
    Ray starts, the data source again when it loads."""
    path = data_file(args.load, rollout_id)
    if os.path.exists(path):
        return True
    if args.allow_fresh_data_position:
        return False
    raise FileNotFoundError(
        f"--load {args.load}: no data-source state at {path} (the position in --prompt-data after rollout "
        f"{rollout_id}, written under --save after every rollout); point --load at the --save directory of "
        "the run, or pass --allow-fresh-data-position to start from the first prompt")


def pop_first(args, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """The default --buffer-filter-path: the oldest groups first (removed from the buffer)."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken


def pop_stalest(args, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """--buffer-sort-by-staleness: groups whose tokens came from the oldest weights first."""
    buffer.sort(key=_oldest_weight_version)
    return pop_first(args, rollout_id, buffer, num_samples)


def _oldest_weight_version(group: list[Sample]) -> float:
    versions = [float(v) for s in group for v in s.weight_versions if str(v).replace(".", "", 1).isdigit()]
    return min(versions, default=float("inf"))  # never generated: after every partly generated group


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """Groups handed back with add_samples (aborted partial rollouts) are served first, through
    --buffer-filter-path `fn(args, rollout_id, buffer, num_samples) -> groups` (default: pop_first),
    which removes what it returns from the buffer."""

    def __init__(self, args):
        super().__init__(args)
        self.buffer: list[list[Sample]] = []
        self.rollout_id: int | None = None  # set by the rollout manager before each rollout
        path = args.buffer_filter_path
        if path:
            from slime.utils.misc import load_function

            self.buffer_filter = load_function(path)
        else:
            self.buffer_filter = pop_stalest if flag(args, "buffer_sort_by_staleness") else pop_first

    def get_samples(self, num_prompts: int) -> list[list[Sample]]:
        with self.lock:
            taken = self.buffer_filter(self.args, self.rollout_id, self.buffer, num_prompts) if self.buffer else []
            if len(taken) > num_prompts:
                raise ValueError(f"--buffer-filter-path returned {len(taken)} groups, more than the {num_prompts} "
                                 "asked for")
            return list(taken) + super().get_samples(num_prompts - len(taken))

    def add_samples(self, samples: list[list[Sample]]) -> None:
        with self.lock:
            for group in samples:
                if len(group) != self.args.n_samples_per_prompt:
                    raise ValueError(f"group of {len(group)} samples, expected --n-samples-per-prompt "
                                     f"{self.args.n_samples_per_prompt}")
                self.buffer.append(group)

    def get_buffer_length(self) -> int:
        return len(self.buffer)

    def _buffer_state(self) -> list[list[dict]]:
        return [[sample.to_dict() for sample in group] for group in self.buffer]

    def _load_buffer(self, groups: list[list[dict]]) -> None:
        self.buffer = [[Sample.from_dict(sample) for sample in group] for group in groups]
