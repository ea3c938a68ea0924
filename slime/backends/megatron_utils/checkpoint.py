"""--save / --load with megatron.core.dist_checkpointing, and --hf-checkpoint loading.

Layout (megatron's): <dir>/iter_0000007/ (a torch_dist checkpoint) and
<dir>/latest_checkpointed_iteration.txt. Every rank of the world calls save/load together
(dist_checkpointing coordinates over the default group); resharding to another TP/PP/CP
layout on load is dist_checkpointing's job.

What an iteration directory holds (model, optimizer, scheduler, every rank's RNG, the refreshed
reference model) is listed in slime/checkpoint/contents.py; its manifest names the items it has.

A save is atomic and durable for --load: it is written under <iter dir>.partial, each rank fsyncs the
files it wrote (on a filesystem shared by nodes one client's fsync does not flush another's writes),
rank 0 fsyncs the whole tree, and it goes into place once every rank has finished; only then is the
tracker replaced (write, fsync, rename, fsync). An iter_N the tracker does not name (a save that died
before its tracker moved) is removed and replaced; the one the tracker names is exchanged out in one
step, never missing. A save that fails anywhere leaves the previous checkpoint and tracker as they
were; a leftover .partial directory is never read and is cleared by the next save of that iteration.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from slime import patches
from slime.checkpoint import contents, durable, layout, rng
from slime.checkpoint.contents import latest_iteration
from slime.distributed.fault_inject import maybe_kill_run
from slime.models import mxfp4
from slime.models.hf_weights import carried_tensors, export_hf_weights, load_hf_weights
from slime.models.lora import peft_unexportable

__all__ = ["save_checkpoint", "publish_checkpoint", "load_checkpoint",
           "load_model_weights", "latest_iteration", "load_hf_weights",
           "export_hf_weights", "save_hf_checkpoint", "load_reference", "load_served", "restore_rng", "holds",
           "plan_resume", "rank_layout"]

logger = logging.getLogger(__name__)

_TRACKER = contents.TRACKER
# HF files copied next to --save-hf weights so the directory loads with transformers / SGLang
_HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json",
                  "preprocessor_config.json")
_PARTIAL = durable.PARTIAL
_GROWTH_POLL_S = 1.0
# Distributed-optimizer state format: Megatron-LM's default. The model itself reloads under any
# layout; optimizer state needs the same TP/PP (DP may change).
_SHARDING_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
_iteration_dir = contents.iteration_dir


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _model_sharded_state_dict(model_chunks: list) -> dict[str, Any]:
    if len(model_chunks) == 1:
        return {"model": _unwrap(model_chunks[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def _merged_model_sharded(model_state: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for state in model_state.values():
        merged.update(state)
    return merged


def _full_sharded_state_dict(model_chunks, optimizer, lr_scheduler, is_loading: bool) -> dict[str, Any]:
    state = _model_sharded_state_dict(model_chunks)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            _merged_model_sharded(state), is_loading=is_loading, metadata=_SHARDING_METADATA)
    if lr_scheduler is not None:
        state["opt_param_scheduler"] = lr_scheduler.state_dict()
    return state


def world_barrier(name: str) -> None:
    """The barrier of callers without a fence (tests, tools): the default group's, bounded by its timeout."""
    dist.barrier()


def save_checkpoint(root: str, iteration: int, model_chunks: list, optimizer=None, lr_scheduler=None, *,
                    progress: Callable[[], None] | None = None,
                    reference: Callable[[], contextlib.AbstractContextManager] | None = None,
                    served: tuple[int, Callable[[], contextlib.AbstractContextManager]] | None = None,
                    barrier: Callable[[str], None] = world_barrier, run_id: str | None = None,
                    publish: bool = True) -> str:
    """Save model (+ optimizer, scheduler), every rank's RNG and (`reference`) the reference model as
    iteration `iteration` under root, atomically and durably. All ranks call.

    `progress()` is called whenever the bytes written grow, and after each file rank 0 fsyncs (the save's
    progress for the deadlines).
    `reference()`: a context in which the model holds the reference weights (saved under reference/).
    `served`: (version, a context in which the model holds the weights the engines hold as that version), saved
    under served/ (train_async.py: the engines are a version behind the trainer).
    `barrier(name)`: where every rank waits for rank 0's directory work or for every rank's shards; the
    trainer passes its fence, which waits while some rank progresses and names the ranks it waits for.
    `run_id`: the saving run, in the manifest. `publish=False`: the iteration directory is put in place but the
    tracker is left as it was (`publish_checkpoint` moves it: the critic's, once the actor's save is published).
    """
    patches.apply_all()  # dist_checkpointing modules imported since start get the CPU patch too
    from megatron.core import dist_checkpointing

    plan = contents.TrainerSave(optimizer=optimizer is not None, reference=reference is not None,
                                served=served is not None)
    path = _iteration_dir(root, iteration)
    partial = path + _PARTIAL
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a failed earlier attempt
        os.makedirs(partial)
    barrier("directory_made")
    state = _full_sharded_state_dict(model_chunks, optimizer, lr_scheduler, is_loading=False)
    state["iteration"] = iteration
    with _progress_while_growing(partial, progress):
        dist_checkpointing.save(state, partial)
        if reference is not None:  # every rank passes one or none (--ref-update-interval)
            _save_copy(partial, contents.reference_dir(partial), model_chunks, reference, barrier, "reference")
        if served is not None:  # every rank passes one or none (the driver's choice)
            _save_copy(partial, contents.served_dir(partial), model_chunks, served[1], barrier, "served")
    durable.write_atomic(contents.rng_file(partial, dist.get_rank()), lambda f: torch.save(rng.capture(), f))
    for own in own_shards(partial, dist.get_rank()):  # durable from this node before any rank publishes
        durable.fsync_path(own)
    maybe_kill_run("kill_during_save", dist.get_rank(), iteration)
    barrier("shards_written")  # every rank's shards are complete
    if dist.get_rank() == 0:
        contents.write_manifest(partial, plan.items(), run_id)
        if served is not None:
            contents.write_served_version(partial, served[0])
        layout.write_layout(partial, rank_layout(optimizer))
        # the iteration the tracker names is never missing; any other (unpublished) one is simply replaced
        durable.publish_dir(partial, path, progress, in_use=latest_iteration(root) == iteration)
        if publish:
            _write_tracker(root, iteration)
    barrier("published")
    return path


def publish_checkpoint(root: str, iteration: int) -> None:
    """The tracker under root names `iteration`, whose directory a `save_checkpoint(publish=False)` put in place.
    Rank 0 writes; every rank calls."""
    if dist.get_rank() == 0:
        if not os.path.isdir(_iteration_dir(root, iteration)):
            raise FileNotFoundError(f"cannot publish iteration {iteration}: {_iteration_dir(root, iteration)} is "
                                    "missing")
        _write_tracker(root, iteration)


def own_shards(partial: str, rank: int) -> list[str]:
    """The shard files this rank wrote into a torch_dist save (megatron names them `__<global rank>_<i>.distcp`),
    the reference model's and the served copy's included."""
    prefix = f"__{rank}_"
    return sorted(os.path.join(base, name) for base, _, names in os.walk(partial)
                  for name in names if name.startswith(prefix))


def _save_copy(partial: str, directory: str, model_chunks: list, holding, barrier: Callable[[str], None],
               what: str) -> None:
    """Another copy of the model's weights (the reference, the served weights) under `directory`."""
    from megatron.core import dist_checkpointing

    barrier(f"{what}_after_model" if what != "reference" else "model_saved")  # the directory may take the copy
    if dist.get_rank() == 0:
        os.makedirs(directory)
    barrier(f"{what}_directory_made")
    with holding():
        dist_checkpointing.save(_model_sharded_state_dict(model_chunks), directory)


def _write_tracker(root: str, iteration: int) -> None:
    durable.write_text_atomic(os.path.join(root, _TRACKER), str(iteration))


@contextlib.contextmanager
def _progress_while_growing(directory: str, progress: Callable[[], None] | None) -> Iterator[None]:
    """Call progress() from a thread each time the bytes under `directory` grow (polled)."""
    if progress is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        size = _tree_bytes(directory)
        while not done.wait(_GROWTH_POLL_S):
            now = _tree_bytes(directory)
            if now > size:
                size = now
                progress()

    watcher = threading.Thread(target=watch, name="checkpoint-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _tree_bytes(directory: str) -> int:
    total = 0
    for base, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):  # a writer may rename or remove files meanwhile
                total += os.path.getsize(os.path.join(base, name))
    return total


@torch.no_grad()  # state copies into (views of) leaf params must not be recorded by autograd
def load_checkpoint(root: str, model_chunks: list, optimizer=None, lr_scheduler=None,
                    iteration: Optional[int] = None) -> int:
    """Load model (+ optimizer, scheduler) in place; returns the loaded iteration. All ranks call."""
    patches.apply_all()
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root) if iteration is None else iteration
    if iteration is None:
        raise FileNotFoundError(f"no {_TRACKER} under {root}")
    if not os.path.isdir(_iteration_dir(root, iteration)):
        raise FileNotFoundError(f"{root}: the tracker names iteration {iteration}, but {_iteration_dir(root, iteration)} "
                                "does not exist; point --load at a complete checkpoint directory")
    stale_optimizer = None
    if optimizer is not None and contents.OPTIMIZER not in holds(root, iteration):
        logger.warning("%s holds no optimizer state (saved with --no-save-optim): starting a fresh optimizer",
                       _iteration_dir(root, iteration))
        stale_optimizer, optimizer = optimizer, None
    state = _full_sharded_state_dict(model_chunks, optimizer, lr_scheduler, is_loading=True)
    state["iteration"] = iteration
    loaded = dist_checkpointing.load(state, _iteration_dir(root, iteration))
    _load_model_state(model_chunks, loaded)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if stale_optimizer is not None:
        stale_optimizer.reload_model_params()  # see load_model_weights
    if lr_scheduler is not None:
        lr_scheduler.num_steps = 0  # its load_state_dict ADDS the saved step count
        lr_scheduler.load_state_dict(loaded["opt_param_scheduler"])
    return int(loaded.get("iteration", iteration))


def _load_model_state(model_chunks: list, loaded: dict[str, Any]) -> None:
    if len(model_chunks) == 1:
        _unwrap(model_chunks[0]).load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(model_chunks):
            _unwrap(chunk).load_state_dict(loaded[f"model{i}"])


def load_model_weights(path: str, model_chunks: list, optimizer, hf_config: Any,
                       iteration: Optional[int] = None) -> None:
    """Model weights only, from an HF directory (config.json) or a megatron checkpoint (its `iteration`,
    default the latest), then the optimizer's main params refreshed from them. All ranks call.

    With --bf16 megatron's optimizer keeps fp32 main params, cloned from the model when it was built
    (random init here) and copied back into the model at every step: weights loaded behind its back
    would be replaced by that init at the first step (seen: a KL to the reference of ~5 nats on
    the H200 within a few rollouts). Megatron-LM reloads them after a checkpoint load the same way.
    """
    if os.path.exists(os.path.join(path, "config.json")):
        load_hf_weights(model_chunks, path, hf_config)
    else:
        load_checkpoint(path, model_chunks, iteration=iteration)
    optimizer.reload_model_params()


def holds(root: str, iteration: int) -> frozenset[str]:
    """The items (slime/checkpoint/contents.py) the iteration directory holds."""
    return contents.read_manifest(_iteration_dir(root, iteration))


@torch.no_grad()
def load_reference(root: str, iteration: int, model_chunks: list) -> None:
    """The reference model saved with the iteration, loaded into model_chunks in place. All ranks call."""
    _load_copy(contents.reference_dir(_iteration_dir(root, iteration)), model_chunks)


@torch.no_grad()
def load_served(root: str, iteration: int, model_chunks: list) -> int:
    """The weights the engines held when the iteration was saved, loaded into model_chunks in place; returns
    their version. All ranks call."""
    path = _iteration_dir(root, iteration)
    _load_copy(contents.served_dir(path), model_chunks)
    return contents.served_version(path)


def _load_copy(directory: str, model_chunks: list) -> None:
    patches.apply_all()
    from megatron.core import dist_checkpointing

    _load_model_state(model_chunks, dist_checkpointing.load(_model_sharded_state_dict(model_chunks), directory))


def rank_layout(optimizer=None) -> layout.SavedLayout:
    """This rank's parallel layout (megatron's groups) and how `optimizer` partitions its state."""
    from megatron.core import parallel_state as ps

    config = getattr(optimizer, "config", None)
    kind = None if optimizer is None else (layout.DISTRIBUTED if config is not None and
                                           config.use_distributed_optimizer else layout.PER_PARAMETER)
    return layout.SavedLayout(
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(), ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(), dp=ps.get_data_parallel_world_size(),
        world_size=dist.get_world_size(), vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
        optimizer=kind, optimizer_parts=len(getattr(optimizer, "chained_optimizers", None) or [optimizer]))


def plan_resume(root: str, iteration: int, optimizer, *, load_optimizer: bool, load_rng: bool,
                random_draws: tuple[str, ...]) -> layout.LayoutResume:
    """What a resume from `iteration` restores at this rank's layout (slime/checkpoint/layout.py); raises
    LayoutResumeError, before anything is loaded, for what it cannot restore."""
    return layout.plan_layout_resume(layout.read_layout(_iteration_dir(root, iteration)), rank_layout(optimizer),
                                     load_optimizer=load_optimizer, load_rng=load_rng, random_draws=random_draws)


def restore_rng(root: str, iteration: int, rank: int) -> bool:
    """This rank's RNG as it was when the iteration was saved; False when the checkpoint has none for it
    (saved before RNG was saved, or by a world of another size)."""
    path = contents.rng_file(_iteration_dir(root, iteration), rank)
    if contents.RNG not in holds(root, iteration) or not os.path.exists(path):
        return False
    rng.restore(torch.load(path, weights_only=True))
    return True


@torch.no_grad()
def save_hf_checkpoint(path: str, model_chunks: list, hf_config: Any, hf_source_dir: str | None, *,
                       barrier: Callable[[str], None] = world_barrier, lora_config: Any = None) -> str:
    """--save-hf: the model as HF safetensors (one file per pipeline stage, with an index when PP > 1),
    plus the config and tokenizer files of --hf-checkpoint. Every rank calls (TP gathers inside export);
    the first TP/DP/CP rank of each PP stage writes."""
    from megatron.core import parallel_state
    from safetensors.torch import save_file

    # clone: split tensors (q/k/v, gate/up) are views of one parameter, which safetensors refuses
    tensors = {name: t.detach().cpu().clone() for name, t in export_hf_weights(model_chunks, hf_config)}
    pp, stage = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_rank()
    if stage == 0 and hf_source_dir:  # what the trainer does not build (a composite's vision tower), unchanged
        tensors.update(carried_tensors(hf_source_dir, hf_config))
    writer = (parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0
              and parallel_state.get_context_parallel_rank() == 0)
    shard = "model.safetensors" if pp == 1 else f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"
    if writer:
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, shard), metadata={"format": "pt"})
    # the shard names of every stage, for the index (one object all-gather over the world)
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, (shard, sorted(tensors)) if writer else None)
    if dist.get_rank() == 0:
        _write_hf_side_files(path, [n for n in names if n is not None], pp, hf_source_dir)
    unexportable = peft_unexportable(model_chunks) if lora_config is not None else None
    if unexportable:
        if dist.get_rank() == 0:
            logger.warning("--save-hf: no PEFT adapter for %s; %s holds the merged weights only (no %s/)",
                           unexportable, path, PEFT_ADAPTER_DIR)
    elif lora_config is not None:
        save_peft_adapter(os.path.join(path, PEFT_ADAPTER_DIR), model_chunks, hf_config, lora_config, writer,
                          base_model=hf_source_dir)
    barrier("hf_published")
    return path


PEFT_ADAPTER_DIR = "lora_adapter"
"""Where --save-hf puts the LoRA adapter in PEFT's format (beside the merged model, which stays a plain HF
checkpoint: an adapter_config.json at its top would make transformers load it as an adapter)."""


def save_peft_adapter(path: str, model_chunks: list, hf_config: Any, lora_config: Any, writer: bool,
                      base_model: str | None) -> None:
    """adapter_model.safetensors + adapter_config.json, as PEFT writes a LoRA adapter (single PP stage)."""
    from megatron.core import parallel_state
    from safetensors.torch import save_file

    from slime.models.hf_weights import export_peft_adapter

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("the PEFT adapter export is written for one pipeline stage; the merged model "
                                  "under --save-hf holds the adapters at any PP size")
    tensors = {name: t.cpu().clone().contiguous() for name, t in export_peft_adapter(model_chunks, hf_config)}
    if not writer:
        return
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    modules = sorted({name.split(".")[-3] for name in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": lora_config.rank, "lora_alpha": lora_config.alpha, "lora_dropout": lora_config.dropout,
              "target_modules": modules, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "use_rslora": False, "init_lora_weights": True}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def _write_hf_side_files(path: str, shards: list, pp: int, hf_source_dir: str | None) -> None:
    if pp > 1:
        weight_map = {name: shard for shard, tensor_names in shards for name in tensor_names}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    for name in _HF_SIDE_FILES:
        source = os.path.join(hf_source_dir or "", name)
        if hf_source_dir and os.path.exists(source):
            shutil.copyfile(source, os.path.join(path, name))
    _write_dequantised_config(path)


def _write_dequantised_config(path: str) -> None:
    """The weights are written in the trainer's dtype: an MXFP4 source's config.json loses its quantization_config."""
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        return
    with open(config_path) as f:
        config = json.load(f)
    dequantised = mxfp4.dequantised_config(config)
    if dequantised is not config:
        with open(config_path, "w") as f:
            json.dump(dequantised, f, indent=2)
