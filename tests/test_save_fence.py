"""The checkpoint save waits for rank 0's filesystem work at the trainer's fences: a rank 0 stuck there is named.

Rank 0 publishes the iteration directory (fsyncs every file, renames it into place, replaces the tracker)
while its peers wait at the fence `save/published`. The product's actor runs on forked gloo ranks
(tests/step_ranks.py); rank 0's fsync of the tree never returns.
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
    try:
        actor.init(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), engine_urls=[])
        args.save = save_dir
        if rank == 0:
            def stuck(root, progress=None):  # a filesystem that stopped answering
                while True:
                    time.sleep(0.05)

            durable.fsync_tree = stuck
        actor.save(0)
    except DistributedStepError as exc:
        return step_ranks.named_error(exc)
    finally:
        actor.ledger.close()
    return None


@pytest.mark.timeout(150)
def test_rank_0_stuck_publishing_a_save_is_named_by_its_peers_and_by_itself(tmp_path):
    checkpoint = save_tiny_qwen3(str(tmp_path / "qwen3"))
    args = step_ranks.step_args(checkpoint, world=2, fence_timeout=FENCE_S)
    stuck, waiting = run_ranks_outcomes(_save_child, 2, init_process_group=False, timeout_s=120,
                                        args=(args, str(tmp_path / "ledger"), str(tmp_path / "save")))
    assert waiting.status == "ok" and waiting.value is not None, waiting
    assert waiting.value["error"] == "FenceTimeoutError" and waiting.value["phase"] == "save/published", waiting.value
    assert waiting.value["ranks"] == [0] and "lagging ranks=[0]" in waiting.value["message"], waiting.value
    assert stuck.status == "ok" and stuck.value is not None, stuck
    assert stuck.value["error"] == "HangError" and "phase=save" in stuck.value["message"], stuck.value
    assert not os.path.exists(tmp_path / "save" / "latest_checkpointed_iteration.txt")  # nothing half-published
