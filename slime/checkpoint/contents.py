"""The list of what a checkpoint of iteration N holds, who writes it and where. Save and load both
read it, so nothing is saved that load ignores, and nothing load needs goes unsaved.

  item            writer            file (under --save / --load)
  model           every rank        iter_N/                    torch_dist shards (megatron's layout)
  optimizer       every rank        iter_N/                    unless --no-save-optim
  scheduler       every rank        iter_N/                    common state
  rng             every rank        iter_N/rng/rank_R.pt       torch CPU + CUDA, Python, numpy, megatron tracker
  reference       every rank        iter_N/reference/          torch_dist; only when --ref-update-interval
                                                               moves the reference away from --ref-load
  served          every rank        iter_N/served/             torch_dist: the weights the engines held (and their
                                                               version) when train_async.py saved, so a resume
                                                               generates the next rollout with them
  iteration       rank 0            latest_checkpointed_iteration.txt (and iter_N/slime_contents.json, with
                                    the id of the run that saved it: `heal_target`)
  layout          rank 0            iter_N/slime_layout.json: the parallel layout and the optimizer's partition,
                                    what a resume at another layout is checked against (slime/checkpoint/layout.py)
  data            rollout manager   rollout/global_dataset_state_dict_N.pt: prompt position, epoch and
                                    its shuffle order, the partial-rollout buffer, the rollout side's RNG
  metrics step    (derived)         N + 1: the driver logs every event under its rollout id

The data file is written after every rollout under --save (the rollout manager's copy of the position
that rollout left); --load reads the one of the iteration the tracker names. Sampling itself needs no
saved state: each sample's seed is derived from --seed, the rollout id and the sample index
(slime/rollout/sampling_seed.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from slime.checkpoint.durable import write_text_atomic
from slime.checkpoint.layout import read_layout

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "slime_contents.json"
RNG_DIR = "rng"
REFERENCE_DIR = "reference"
SERVED_DIR = "served"
SERVED_VERSION = "version.json"
DATA_DIR = "rollout"

MODEL, OPTIMIZER, SCHEDULER, RNG, REFERENCE, SERVED = "model", "optimizer", "scheduler", "rng", "reference", "served"
TRAINER_ITEMS = (MODEL, OPTIMIZER, SCHEDULER, RNG, REFERENCE, SERVED)
# The keys of the data file (RolloutDataSource.state_dict): every one is needed for an exact resume.
DATA_POSITION = ("epoch_id", "sample_offset", "sample_group_index", "sample_index")
DATA_ITEMS = (*DATA_POSITION, "epoch_order", "buffer", "outstanding", "rng")
# A checkpoint written before the manifest listed its items held these (optimizer unless it said not).
_LEGACY_ITEMS = (MODEL, OPTIMIZER, SCHEDULER)


class CheckpointMismatchError(ValueError):
    """The parts of a checkpoint a run resumes from do not fit together (the critic's and the actor's)."""


@dataclass(frozen=True, kw_only=True)
class TrainerSave:
    """Which trainer items one save writes."""

    optimizer: bool
    """False under --no-save-optim."""
    reference: bool
    """True when the reference model is refreshed (--ref-update-interval), so --ref-load no longer holds it."""
    served: bool = False
    """True when the engines hold other weights than the trainer's (train_async.py: one version behind)."""

    def items(self) -> tuple[str, ...]:
        return tuple(name for name in TRAINER_ITEMS
                     if (name != OPTIMIZER or self.optimizer) and (name != REFERENCE or self.reference)
                     and (name != SERVED or self.served))


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rng_file(iteration_path: str, rank: int) -> str:
    return os.path.join(iteration_path, RNG_DIR, f"rank_{rank:05d}.pt")


def reference_dir(iteration_path: str) -> str:
    return os.path.join(iteration_path, REFERENCE_DIR)


def served_dir(iteration_path: str) -> str:
    return os.path.join(iteration_path, SERVED_DIR)


def write_served_version(iteration_path: str, version: int) -> None:
    write_text_atomic(os.path.join(served_dir(iteration_path), SERVED_VERSION), json.dumps({"version": version}))


def served_version(iteration_path: str) -> int | None:
    """The weight version of the served copy the iteration holds (None: it holds none)."""
    path = os.path.join(served_dir(iteration_path), SERVED_VERSION)
    if SERVED not in read_manifest(iteration_path) or not os.path.exists(path):
        return None
    with open(path) as handle:
        return int(json.load(handle)["version"])


def data_file(root: str, rollout_id: int) -> str:
    """upstream's name, so its tools find it"""
    return os.path.join(root, DATA_DIR, f"global_dataset_state_dict_{rollout_id}.pt")


def write_manifest(iteration_path: str, items: tuple[str, ...], run_id: str | None = None) -> None:
    """`run_id`: the run that saves (a restart goes back only to its own run's checkpoints)."""
    manifest = {"items": list(items), "optimizer": OPTIMIZER in items}
    if run_id is not None:
        manifest["run_id"] = run_id
    write_text_atomic(os.path.join(iteration_path, MANIFEST), json.dumps(manifest))


def _manifest(iteration_path: str) -> dict:
    path = os.path.join(iteration_path, MANIFEST)
    if not os.path.exists(path):
        return {}
    with open(path) as handle:
        return json.load(handle)


def read_manifest(iteration_path: str) -> frozenset[str]:
    """The items an iteration directory holds (older saves: model, scheduler, optimizer unless marked)."""
    manifest = _manifest(iteration_path)
    if not manifest:
        return frozenset(_LEGACY_ITEMS)
    if "items" in manifest:
        return frozenset(manifest["items"])
    return frozenset(name for name in _LEGACY_ITEMS if name != OPTIMIZER or manifest.get("optimizer", True))


def latest_iteration(root: str) -> int | None:
    """The iteration the tracker under `root` names (None without a tracker). The driver reads it before
    Ray starts, so this module stays free of megatron."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker} holds {text[:40]!r}, not an iteration number; write the number of a "
                         f"complete iter_* directory under {root} into it, or delete it to start fresh")
    return int(text)


def written_by(root: str, iteration: int) -> str | None:
    """The id of the run that saved the iteration (None: no manifest, or one from before manifests named it)."""
    return _manifest(iteration_dir(root, iteration)).get("run_id")


def heal_target(root: str, run_id: str, started_from: int | None = None) -> int | None:
    """The iteration a restart of run `run_id` may go back to: the one the tracker under `root` names, when this
    run saved it or it is the checkpoint the run started from (`started_from`, read from `root` at the start);
    None otherwise (no tracker, or another run's checkpoint). Whatever removes old checkpoints keeps this one."""
    latest = latest_iteration(root)
    if latest is None:
        return None
    if latest == started_from or written_by(root, latest) == run_id:
        return latest
    return None


def load_view(root: str, iteration: int | None = None) -> dict:
    """What this process sees of a weights source before a collective load: the kind (HF or megatron), the
    iteration the tracker names, what that iteration holds. Every rank must see the same (ranks that decide
    differently whether and what to load meet in different collectives); an unreadable tracker is part of
    the view, so that it is fenced like the rest and raised by the load itself on every rank."""
    if os.path.exists(os.path.join(root, "config.json")):
        weights = (".safetensors", ".bin", ".index.json")  # the files a load reads (not side files a node may add)
        return {"kind": "hf", "files": sorted(f for f in os.listdir(root) if f.endswith(weights))}
    try:
        iteration = latest_iteration(root) if iteration is None else iteration
    except (OSError, ValueError) as exc:
        return {"kind": "megatron", "error": f"{type(exc).__name__}: {exc}"}
    if iteration is None:
        return {"kind": "megatron", "iteration": None, "exists": os.path.isdir(root)}
    path = iteration_dir(root, iteration)
    if not os.path.isdir(path):
        return {"kind": "megatron", "iteration": iteration, "exists": False}
    rng_dir = os.path.join(path, RNG_DIR)
    saved_layout = read_layout(path)
    return {"kind": "megatron", "iteration": iteration, "exists": True, "items": sorted(read_manifest(path)),
            "rng_files": len(os.listdir(rng_dir)) if os.path.isdir(rng_dir) else 0,
            "layout": saved_layout.describe() if saved_layout is not None else None}
