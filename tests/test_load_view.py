"""Init is fenced on what each rank sees of the checkpoints it loads: a rank with another view is named.

Each rank reads --load (and --hf-checkpoint, --ref-load, the OPD teacher) itself to decide whether and what
to load; those loads are collectives. Before any of them, every rank fences its view (slime.checkpoint.contents
.load_view): a node with a stale or missing copy ends init with a CollectiveDivergenceError naming it.
"""
from __future__ import annotations

import os

import pytest

import step_ranks
from mp_utils import run_ranks_outcomes
from slime.checkpoint import contents
from tiny_models import save_tiny_qwen3


def _fake_checkpoint(root, iteration: int, items=("model", "scheduler"), rng_ranks: int = 2) -> str:
    """A tracker, an iteration directory with its manifest and RNG files: what a view reads (no shards)."""
    path = contents.iteration_dir(str(root), iteration)
    os.makedirs(os.path.join(path, contents.RNG_DIR))
    contents.write_manifest(path, tuple(items))
    for rank in range(rng_ranks):
        open(contents.rng_file(path, rank), "wb").close()
    (root / contents.TRACKER).write_text(str(iteration))
    return str(root)


def test_load_view_reads_the_tracker_the_items_and_errors(tmp_path):
    root = _fake_checkpoint(tmp_path / "ckpt", 3, items=("model", "optimizer"))
    assert contents.load_view(root) == {"kind": "megatron", "iteration": 3, "exists": True,
                                        "items": ["model", "optimizer"], "rng_files": 2, "layout": None}
    assert contents.load_view(root, 5) == {"kind": "megatron", "iteration": 5, "exists": False}
    assert contents.load_view(str(tmp_path / "none")) == {"kind": "megatron", "iteration": None, "exists": False}
    (tmp_path / "ckpt" / contents.TRACKER).write_text("garbage")
    assert "not an iteration number" in contents.load_view(root)["error"]
    hf = save_tiny_qwen3(str(tmp_path / "hf"))
    view = contents.load_view(hf)
    assert view["kind"] == "hf" and "model.safetensors" in view["files"] and "tokenizer.json" not in view["files"]


def _init_child(rank: int, world: int, args, ledger_dir: str, loads: list[str]):
    from slime.backends.megatron_utils.actor import MegatronTrainActor
    from slime.distributed.errors import CollectiveDivergenceError

    args.load = loads[rank]
    actor = MegatronTrainActor(args, rank, world, ledger_dir)
    try:
        actor.init(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), engine_urls=[])
    except CollectiveDivergenceError as exc:
        return step_ranks.named_error(exc)
    finally:
        actor.ledger.close()
    return None


@pytest.mark.ranks
@pytest.mark.timeout(150)
def test_rank_with_a_stale_checkpoint_view_is_named_before_any_load(tmp_path):
    """Rank 1's copy of --load names iteration 2 where rank 0's names 3 (a node that missed the last save):
    both ranks stop at the init/load_view fence, naming rank 1 and the `load` source, before the model is built."""
    hf = save_tiny_qwen3(str(tmp_path / "hf"))
    fresh = _fake_checkpoint(tmp_path / "node0", 3)
    stale = _fake_checkpoint(tmp_path / "node1", 2)
    args = step_ranks.step_args(hf, world=2, fence_timeout=30)
    outcomes = run_ranks_outcomes(_init_child, 2, init_process_group=False, timeout_s=120,
                                  args=(args, str(tmp_path / "ledger"), [fresh, stale]))
    for outcome in outcomes:
        assert outcome.status == "ok", outcome
        error = outcome.value
        assert error is not None and error["error"] == "CollectiveDivergenceError", error
        assert error["phase"] == "init/load_view" and error["ranks"] == [1] and error["fields"] == ["load"], error
        assert '"iteration": 2' in error["message"] and '"iteration": 3' in error["message"], error["message"]
