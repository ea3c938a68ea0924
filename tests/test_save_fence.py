"""The checkpoint save waits for rank 0's filesystem work at the trainer's fences: a rank 0 stuck there is named;
--keep-checkpoint-num prunes what no restart goes back to.

Rank 0 publishes the iteration directory (fsyncs every file, renames it into place, replaces the tracker)
while its peers wait at the fence `save/published`, then (--keep-checkpoint-num) deletes the older checkpoints.
The product's actor runs on forked gloo ranks (tests/step_ranks.py): three saves with --keep-checkpoint-num 1,
then one whose fsync of the tree never returns on rank 0.
"""
from __future__ import annotations

import os

import pytest

import step_ranks
from mp_utils import run_ranks_outcomes
from tiny_models import save_tiny_qwen3

pytestmark = pytest.mark.ranks

FENCE_S = 4.0


def _save_child(rank: int, world: int, args, ledger_dir: str, save_dir: str):
    import time

    from slime.backends.megatron_utils.actor import MegatronTrainActor
    from slime.checkpoint import durable
    from slime.distributed.errors import DistributedStepError

    actor = MegatronTrainActor(args, rank, world, ledger_dir)
    critic = os.path.join(save_dir, "critic")  # the other role's root: its tracker protects what it names
    try:
        actor.init(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), engine_urls=[])
        args.save, args.keep_checkpoint_num, args.checkpoint_roots = save_dir, 1, (save_dir, critic)
        kept = []
        for iteration in range(3):
            if rank == 0 and iteration:  # the critic saved the iteration before (it saves after the actor)
                os.makedirs(os.path.join(critic, f"iter_{iteration - 1:07d}"))
                with open(os.path.join(critic, "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write(str(iteration - 1))
            actor.save(iteration)
            actor.groups.fence("test/pruned", {"iteration": iteration})  # rank 0's deletion is done
            kept.append(sorted(name for name in os.listdir(save_dir) if name.startswith("iter_")))
        if rank == 0:
            def stuck(root, progress=None):  # a filesystem that stopped answering
                while True:
                    time.sleep(0.05)

            durable.fsync_tree = stuck
        actor.save(3)
    except DistributedStepError as exc:
        return {**step_ranks.named_error(exc), "kept": kept}
    finally:
        actor.ledger.close()
    return None


@pytest.mark.timeout(150)
def test_rank_0_stuck_publishing_a_save_is_named_by_its_peers_and_by_itself_after_pruning_saves(tmp_path):
    checkpoint = save_tiny_qwen3(str(tmp_path / "qwen3"))
    args = step_ranks.step_args(checkpoint, world=2, fence_timeout=FENCE_S)
    stuck, waiting = run_ranks_outcomes(_save_child, 2, init_process_group=False, timeout_s=120,
                                        args=(args, str(tmp_path / "ledger"), str(tmp_path / "save")))
    assert waiting.status == "ok" and waiting.value is not None, waiting
    assert waiting.value["error"] == "FenceTimeoutError" and waiting.value["phase"] == "save/published", waiting.value
    assert waiting.value["ranks"] == [0] and "lagging ranks=[0]" in waiting.value["message"], waiting.value
    assert stuck.status == "ok" and stuck.value is not None, stuck
    assert stuck.value["error"] == "HangError" and "phase=save" in stuck.value["message"], stuck.value
    assert (tmp_path / "save" / "latest_checkpointed_iteration.txt").read_text() == "2"  # nothing half-published
    assert not (tmp_path / "save" / "iter_0000003").exists()
    # --keep-checkpoint-num 1: the newest, and what the critic's tracker (one behind) names, never anything older
    assert stuck.value["kept"] == waiting.value["kept"] == [
        ["iter_0000000"], ["iter_0000000", "iter_0000001"], ["iter_0000001", "iter_0000002"]]
