"""What a checkpoint holds and how it reaches the disk: the manifest (with the run that saved it), RNG states, the
refreshed reference model, fsynced writes (each rank its own shards), a save over an iteration that never became
current without an atomic exchange (NFS has none), and a re-save that never leaves the iteration missing (2 gloo
ranks for the megatron round trip)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from mp_utils import run_ranks
from tiny_models import save_tiny_qwen3
from train_step_harness import build_loaded_model, model_args

from slime.checkpoint import contents, durable, rng

pytestmark = pytest.mark.ranks


def test_trainer_save_lists_only_what_it_writes():
    assert contents.TrainerSave(optimizer=True, reference=False).items() == ("model", "optimizer", "scheduler", "rng")
    assert contents.TrainerSave(optimizer=False, reference=True).items() == ("model", "scheduler", "rng", "reference")
    assert contents.TrainerSave(optimizer=False, reference=False, served=True).items()[-1] == "served"


def test_manifest_of_older_checkpoints_is_read_as_what_they_held(tmp_path):
    assert contents.read_manifest(str(tmp_path)) == {"model", "optimizer", "scheduler"}
    (tmp_path / contents.MANIFEST).write_text(json.dumps({"optimizer": False}))  # a --no-save-optim save
    assert contents.read_manifest(str(tmp_path)) == {"model", "scheduler"}
    contents.write_manifest(str(tmp_path), ("model", "rng"))
    assert contents.read_manifest(str(tmp_path)) == {"model", "rng"}


def test_rng_capture_restores_every_generator():
    import random

    import numpy

    state = rng.capture(tracker=False)
    expected = (float(torch.rand(1)), random.random(), float(numpy.random.rand()))
    torch.manual_seed(99), random.seed(99), numpy.random.seed(99)
    rng.restore(state)
    assert (float(torch.rand(1)), random.random(), float(numpy.random.rand())) == expected


def test_resave_swaps_the_iteration_in_without_a_gap(tmp_path, monkeypatch):
    """The older save is exchanged out atomically: at every later step the iteration holds a whole save."""
    path, partial = tmp_path / "iter_0000003", tmp_path / "iter_0000003.partial"
    for directory, text in ((path, "old"), (partial, "new")):
        directory.mkdir()
        (directory / "shard").write_text(text)
    seen, fsynced = [], []
    real_rmtree, real_fsync = durable.shutil.rmtree, durable.fsync_path
    monkeypatch.setattr(durable.shutil, "rmtree", lambda p: seen.append((path / "shard").read_text()) or real_rmtree(p))
    monkeypatch.setattr(durable, "fsync_path", lambda p: fsynced.append(os.path.basename(p)) or real_fsync(p))
    durable.publish_dir(str(partial), str(path))
    assert seen == ["new"] and (path / "shard").read_text() == "new" and not partial.exists()
    assert "shard" in fsynced and fsynced.count(tmp_path.name) >= 2  # the shard, and the parent after each rename


@pytest.mark.parametrize("present, keep, floor, deleted", [
    ([1, 2, 3, 4], 2, 4, [1, 2]),
    ([1, 2, 3, 4], 1, 2, [1]),  # another role's tracker at 2 protects 2 and 3
    ([1, 2, 3, 5], 1, 3, [1, 2]),  # 5 published without its tracker (a crash between): 3 is still kept
    ([1, 2], 1, None, []),  # no tracker yet: nothing is published, nothing goes
])
def test_keep_checkpoint_num_keeps_the_newest_and_whatever_a_tracker_names(present, keep, floor, deleted):
    from slime.checkpoint.retention import iterations_to_delete

    assert iterations_to_delete(present, keep, floor) == deleted


def test_pruning_deletes_complete_iterations_only_and_finishes_an_interrupted_delete(tmp_path):
    from slime.checkpoint.retention import prune

    for name in ("iter_0000001", "iter_0000002", "iter_0000003", "iter_0000004.partial", "iter_0000000.deleting"):
        (tmp_path / name / "shard").mkdir(parents=True)
        (tmp_path / name / "shard" / "0.distcp").write_bytes(b"x" * 10)
    (tmp_path / contents.TRACKER).write_text("3")
    ticks = []
    assert prune(str(tmp_path), 2, [str(tmp_path)], progress=lambda: ticks.append(1)) == [1]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000003", "iter_0000004.partial", contents.TRACKER]
    assert len(ticks) == 2  # one per file removed: iter_1's and the leftover's


def test_an_iteration_that_never_became_current_is_replaced_without_an_exchange(tmp_path, monkeypatch):
    """A save that died between its directory and the tracker leaves iter_N; saving N again must work where
    renameat2(RENAME_EXCHANGE) does not (NFS), or every restart that redoes N fails the same way."""
    path, partial = tmp_path / "iter_0000003", tmp_path / "iter_0000003.partial"
    for directory, text in ((path, "unpublished"), (partial, "new")):
        directory.mkdir()
        (directory / "shard").write_text(text)

    def no_exchange(a, b):
        raise OSError(22, "RENAME_EXCHANGE not supported", b)

    monkeypatch.setattr(durable, "exchange", no_exchange)
    durable.publish_dir(str(partial), str(path), in_use=False)
    assert (path / "shard").read_text() == "new" and not partial.exists()


def test_atomic_write_replaces_whole_files_only(tmp_path):
    target = tmp_path / "sub" / "state.pt"
    durable.write_text_atomic(str(target), "one")

    def fails(handle):
        handle.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        durable.write_atomic(str(target), fails)
    assert target.read_text() == "one"


def _round_trip(rank, world, hf_dir, ckpt):
    import random

    import numpy

    from slime.backends.megatron_utils.actor import WeightSnapshots
    from slime.backends.megatron_utils.checkpoint import (holds, load_checkpoint, load_reference, load_served,
                                                          restore_rng, save_checkpoint)

    model, optimizer, scheduler = build_loaded_model(model_args(lr=1e-2, use_distributed_optimizer=True), hf_dir)
    model[0].zero_grad_buffer()  # one optimizer step on the same gradient everywhere: state worth saving
    for p in model[0].parameters():
        p.main_grad.fill_(1e-3)
    optimizer.step()
    scheduler.step(1)
    snapshots = WeightSnapshots(model)
    snapshots.take("ref")
    with torch.no_grad():  # the actor moved away from its reference
        for p in model[0].parameters():
            p.mul_(1.5)
    with torch.no_grad():  # what the engines hold: yet other weights (train_async.py: a version behind)
        for p in model[0].parameters():
            p.mul_(0.5)
    snapshots.take("served")
    with torch.no_grad():
        for p in model[0].parameters():
            p.mul_(2.0)
    saved = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    reference = {n: t.clone() for n, t in snapshots._saved["ref"].items()}
    served = {n: t.clone() for n, t in snapshots._saved["served"].items()}
    torch.manual_seed(17 + rank), random.seed(17 + rank), numpy.random.seed(17 + rank)
    waits, ticks = [], []

    def barrier(name: str) -> None:  # the trainer passes its fence here
        waits.append(name)
        torch.distributed.barrier()

    stale = os.path.join(ckpt, "iter_0000003")  # a save of 3 that died after its directory, before the tracker
    if rank == 0:
        os.makedirs(stale)
        open(os.path.join(stale, "left_by_the_dead_save"), "w").close()
    fsynced, real_fsync, real_exchange = [], durable.fsync_path, durable.exchange

    def no_exchange(a, b):  # a filesystem without renameat2(RENAME_EXCHANGE) (NFS)
        raise OSError(22, "RENAME_EXCHANGE not supported", b)

    durable.fsync_path = lambda path: fsynced.append(path) or real_fsync(path)
    durable.exchange = no_exchange
    torch.distributed.barrier()
    save_checkpoint(ckpt, 3, model, optimizer, scheduler, reference=lambda: snapshots.swapped("ref"),
                    served=(3, lambda: snapshots.swapped("served")), barrier=barrier,
                    progress=lambda: ticks.append(rank), run_id="run-a")
    durable.fsync_path, durable.exchange = real_fsync, real_exchange
    saved_by = contents.written_by(ckpt, 3)
    # each rank fsyncs the shards it wrote itself (another node's fsync would not flush them)
    partial = stale + ".partial"
    shards = sorted(os.path.relpath(p, partial) for p in fsynced if p.startswith(partial) and p.endswith(".distcp"))
    state = rng.capture()
    save_checkpoint(ckpt, 3, model, optimizer, scheduler, reference=lambda: snapshots.swapped("ref"),
                    served=(3, lambda: snapshots.swapped("served")))  # a re-save
    rng.restore(state)
    expected = (float(torch.rand(1)), random.random(), float(numpy.random.rand()))
    with torch.no_grad():
        for p in model[0].parameters():
            p.add_(1.0)
    snapshots.take("ref")  # as --ref-load would have set it
    torch.manual_seed(0), random.seed(0), numpy.random.seed(0)
    iteration = load_checkpoint(ckpt, model, optimizer, scheduler)
    restored_rng = restore_rng(ckpt, iteration, rank)
    drawn = (float(torch.rand(1)), random.random(), float(numpy.random.rand()))
    snapshots.capture("ref", lambda: load_reference(ckpt, iteration, model))
    versions = []
    snapshots.capture("served", lambda: versions.append(load_served(ckpt, iteration, model)))
    return {
        "served": versions == [3] and all(torch.equal(served[n], t) for n, t in snapshots._saved["served"].items()),
        "iteration": iteration,
        "items": sorted(holds(ckpt, iteration)),
        "model": all(torch.equal(saved[n], p) for n, p in model[0].named_parameters()),
        "reference": all(torch.equal(reference[n], t) for n, t in snapshots._saved["ref"].items()),
        "rng": restored_rng and drawn == expected,
        "leftovers": sorted(n for n in os.listdir(ckpt) if n.endswith(".partial")),
        "stale": os.path.exists(os.path.join(stale, "left_by_the_dead_save")),
        "fsynced_shards": shards,
        "run": saved_by,
        "waits": waits,
        "ticks": len(ticks),
    }


@pytest.mark.timeout(200)
def test_checkpoint_round_trip_restores_model_reference_and_every_ranks_rng(tmp_path):
    hf_dir = save_tiny_qwen3(str(tmp_path / "tiny_qwen3"))
    results = run_ranks(_round_trip, 2, args=(hf_dir, str(tmp_path / "ckpt")), timeout_s=190)
    ticks = [result.pop("ticks") for result in results]
    # rank 0 fsyncs every file of the iteration before publishing it: each counts as progress for its peers
    files = sum(len(names) for _, _, names in os.walk(tmp_path / "ckpt" / "iter_0000003"))
    assert ticks[0] >= files > 0, (ticks, files)
    # every shard of the save (model and optimizer, reference model, served copy) was fsynced by the rank that wrote it
    iteration = tmp_path / "ckpt" / "iter_0000003"
    for rank, result in enumerate(results):
        written = sorted(str(p.relative_to(iteration)) for p in iteration.rglob(f"__{rank}_*.distcp"))
        assert written and set(written) <= set(result.pop("fsynced_shards")), (rank, written)
    for result in results:
        # every wait of the save goes through the caller's barrier (the trainer's fence), none bare
        assert result.pop("waits") == ["directory_made", "model_saved", "reference_directory_made",
                                       "served_after_model", "served_directory_made", "shards_written",
                                       "published"], result
        assert result == {"iteration": 3, "items": ["model", "optimizer", "reference", "rng", "scheduler", "served"],
                          "model": True, "reference": True, "served": True, "rng": True, "leftovers": [],
                          "stale": False, "run": "run-a"}, result
