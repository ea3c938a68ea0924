"""Eval datasets: `--eval-prompt-data NAME PATH ...` or upstream's multi-task `--eval-config FILE` (YAML or JSON).

    eval:                                  # optional wrapper; the root may be this mapping itself
      defaults: {n_samples_per_eval_prompt: 4, max_response_len: 1024}
      datasets:                            # a list of entries with `name`, or a mapping name -> entry
        - {name: aime, path: /data/aime.jsonl, rm_type: deepscaler, temperature: 0.6}
        - {name: gpqa, path: /data/gpqa.jsonl, rm_type: gpqa, input_key: question, top_p: 0.95}

An entry's unset fields take `defaults`, then the --eval-* / rollout flags. `rm_type` and `metadata_overrides`
go into each sample's metadata (rm_hub grades by the sample's own rm_type). With --eval-config the
--eval-prompt-data pairs are derived from it, as upstream does.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# sampling fields of an entry -> SGLang sampling parameter
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "max_response_len": "max_new_tokens", "min_new_tokens": "min_new_tokens", "stop": "stop",
                   "stop_token_ids": "stop_token_ids"}
# names upstream's configs use for the same field
ALIASES = {"prompt_key": "input_key"}


@dataclass(frozen=True)
class EvalDatasetSpec:
    """One eval dataset; None fields fall back to the --eval-* / rollout flags."""

    name: str
    path: str
    rm_type: str | None = None
    input_key: str | None = None
    label_key: str | None = None
    tool_key: str | None = None
    metadata_key: str | None = None
    n_samples_per_eval_prompt: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_response_len: int | None = None
    min_new_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    multimodal_keys: dict[str, str] | None = field(default=None, hash=False)  # upstream's per-dataset override
    metadata_overrides: dict[str, Any] = field(default_factory=dict, hash=False)

    def sampling_overrides(self) -> dict[str, Any]:
        return {param: getattr(self, name) for name, param in SAMPLING_FIELDS.items() if getattr(self, name) is not None}

    def sample_metadata(self, metadata: dict) -> dict:
        """A sample's metadata with this dataset's rm_type and overrides."""
        merged = dict(metadata or {})
        if self.rm_type is not None:
            merged["rm_type"] = self.rm_type
        return {**merged, **self.metadata_overrides}


def parse_eval_config(data: Any, origin: str) -> tuple[EvalDatasetSpec, ...]:
    """The datasets of a loaded --eval-config document; errors name the file and the entry."""
    if not isinstance(data, dict):
        raise ValueError(f"--eval-config {origin}: expected a mapping at the root, got {type(data).__name__}")
    section = data.get("eval", data)
    if not isinstance(section, dict):
        raise ValueError(f"--eval-config {origin}: `eval` must be a mapping")
    defaults = dict(section.get("defaults") or {})
    entries = _entries(section.get("datasets"), origin)
    if not entries:
        raise ValueError(f"--eval-config {origin}: no datasets under `eval.datasets`")
    specs = tuple(_spec({**defaults, **{k: v for k, v in entry.items() if v is not None}}, origin) for entry in entries)
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--eval-config {origin}: dataset names repeat: {names}")
    return specs


def _entries(datasets: Any, origin: str) -> list[dict]:
    if datasets is None:
        return []
    if isinstance(datasets, dict):
        return [{"name": name, **dict(entry or {})} for name, entry in datasets.items()]
    if isinstance(datasets, list):
        for index, entry in enumerate(datasets):
            if not isinstance(entry, dict) or "name" not in entry:
                raise ValueError(f"--eval-config {origin}: datasets[{index}] needs a `name` (and a `path`)")
        return [dict(entry) for entry in datasets]
    raise ValueError(f"--eval-config {origin}: `datasets` must be a list or a mapping, got {type(datasets).__name__}")


def _spec(entry: dict, origin: str) -> EvalDatasetSpec:
    entry = {ALIASES.get(key, key): value for key, value in entry.items()}
    known = {f.name for f in dataclasses.fields(EvalDatasetSpec)}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ValueError(f"--eval-config {origin}: dataset {entry.get('name')!r} has unknown fields {unknown} "
                         f"(known: {sorted(known)})")
    if not entry.get("path"):
        raise ValueError(f"--eval-config {origin}: dataset {entry.get('name')!r} has no `path`")
    for key in ("stop", "stop_token_ids"):
        if entry.get(key) is not None:
            value = entry[key]
            entry[key] = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    entry["name"], entry["path"] = str(entry["name"]), str(entry["path"])
    return EvalDatasetSpec(**entry)


def load_eval_config(path: str) -> tuple[EvalDatasetSpec, ...]:
    import yaml  # JSON is YAML too

    with open(path) as handle:
        try:
            data = yaml.safe_load(handle)
        except yaml.YAMLError as exc:
            raise ValueError(f"--eval-config {path}: not YAML/JSON ({exc})") from None
    return parse_eval_config(data, path)
