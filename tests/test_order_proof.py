"""The order proof on the real step: `python train.py` with every rank's whole collective sequence recorded.

The main run is the session's #1487 recording (conftest.py; slime.tools.record_step_sequence: 8 ranks,
TP2 x SP x CP4, --colocate, dynamic batches, per-token loss, one engine, 2 rollouts of 2 steps with
sleep/wake and the weight sync). For every process group, all of its members must have recorded the
same sequence of (op, shape, dtype); the same on 4 ranks as TP2 x DP2 with
--recreate-process-groups-on-wake and two engines (one run for both). A rank that skips one
collective of the real step (skip_collective, the recording replayed on 4 ranks as CP4) must break the
proof, naming that rank, and stop the run with a named error. The committed docs/step_sequence.md
must be what the renderer makes of the main run.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import ISSUE_RECORDING_TIMEOUT_S
from train_runs import assert_named_stop, train_env

from slime.distributed.order_proof import check_order, read_sequences
from slime.tools.record_step_sequence import record, train_flags
from slime.tools.render_step_sequence import render, rollout_windows

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = ISSUE_RECORDING_TIMEOUT_S


def _metrics(out: Path) -> dict[str, list[dict]]:
    events: dict[str, list[dict]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        events.setdefault(event["event"], []).append(event)
    return events


def _read_run(proc, out: Path) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"out": out, "sequences": read_sequences(str(out / "ledger")), "metrics": _metrics(out)}


def _group_sizes(sequences, rank: int = 0) -> dict[str, int]:
    return {op.group: len(op.ranks) for op in sequences[rank].ops}


def _plan_notes(sequences, rank: int = 0) -> list[dict]:
    return [n.fields for n in sequences[rank].notes if n.kind == "fence:actor_train/plan"]


def _assert_proof_holds(run: dict, *, sizes: dict[str, int]) -> None:
    sequences = run["sequences"]
    assert sorted(sequences) == list(range(sizes["world"]))
    report = check_order(sequences)
    assert report.ok, report.format()
    assert {name: _group_sizes(sequences)[name] for name in sizes} == sizes
    for rank, sequence in sequences.items():  # both rollouts: train, sleep, wake, weight sync
        windows = rollout_windows(sequence)
        assert len(windows) == 2, f"rank {rank}: {len(windows)} rollouts recorded"
        for window in windows:
            phases = {op.phase for op in window}
            for phase in ("actor_train/wake", "actor_train/forward_backward", "sleep", "weight_sync/wake",
                          "weight_sync/push"):
                assert any(p.startswith(phase) for p in phases), f"rank {rank}: no {phase} in {sorted(phases)}"
    # the weight sync's TP gathers of the exporters are in the proof, not only the fences
    assert any(op.phase.startswith("weight_sync/push/") and op.group == "tp" for op in sequences[0].ops)
    events = run["metrics"]
    assert [e["weight_sync/version"] for e in events["weight_sync"]][-2:] == [1, 2]  # after each rollout
    for plan in _plan_notes(sequences):  # micro-batch counts differ between the steps of each rollout
        counts = plan["micro_batches_per_step"]
        assert all(len(set(per_dp)) > 1 for per_dp in counts), counts


@pytest.fixture(scope="module")
def issue_run(issue_recording) -> dict:
    return _read_run(issue_recording["proc"], issue_recording["out"])


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_every_group_records_one_sequence_on_the_issue_layout(issue_run):
    _assert_proof_holds(issue_run, sizes={"world": 8, "tp": 2, "cp": 4, "dp": 1, "dp_cp": 4})


@pytest.mark.timeout(120)
def test_recorded_plan_has_uneven_steps_and_uneven_cp_slices(issue_run):
    """The conditions of upstream #1487's hang held in this run: recomputed from the saved rollouts, the plans
    equal what every rank claimed at the plan fence, and their CP slices carry unequal loss tokens (some none)."""
    from slime.backends.megatron_utils.data import pack_micro_batch, plans_from_rollout
    from slime.rollout.train_data import samples_to_train_data
    from slime.utils.arguments import parse_args
    from slime.utils.types import Sample

    out = issue_run["out"]
    args = parse_args(train_flags(out))
    claimed = _plan_notes(issue_run["sequences"])
    assert [c["rollout_id"] for c in claimed] == [0, 1]
    for rollout_id, plan_fields in enumerate(claimed):
        saved = torch.load(out / f"rollout_{rollout_id}.pt", weights_only=False)
        data = samples_to_train_data(args, [Sample.from_dict(d) for d in saved["samples"]])
        plans = plans_from_rollout(data, args, dp_size=1, dp_rank=0)
        assert [[list(p.token_counts) for p in plans]] == plan_fields["micro_batch_tokens"]
        per_cp = [[int(pack_micro_batch(data, mb, cp_size=4, cp_rank=r, tp_size=2, sequence_parallel=True)
                       .loss_mask.sum()) for r in range(4)] for p in plans for mb in p.micro_batches]
        assert all(len(set(counts)) > 1 for counts in per_cp), per_cp
        assert any(0 in counts for counts in per_cp), per_cp


@pytest.mark.timeout(120)
def test_committed_step_sequence_doc_is_the_render_of_a_fresh_run(issue_run):
    committed = (ROOT / "docs" / "step_sequence.md").read_text()
    fresh = render(issue_run["sequences"], rollout_index=1, rank=0)
    assert fresh == committed, "docs/step_sequence.md is stale: run `make step-sequence` and commit the result"


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_every_group_records_one_sequence_on_tp2_dp2_with_recreated_process_groups(tmp_path):
    """Upstream's colocate behaviour on a layout with DP: groups destroyed at sleep, re-created and warmed at
    wake; the model and optimizer follow the new groups, the next rollout trains and its weights are pushed
    to two engines of 2 GPUs each. Each DP rank packs micro-batches of up to 96 tokens (CP1), so the two
    steps of a rollout still get different micro-batch counts."""
    extra = ["--actor-num-gpus-per-node", "4", "--context-parallel-size", "1", "--max-tokens-per-gpu", "96",
             "--rollout-num-gpus-per-engine", "2", "--recreate-process-groups-on-wake"]
    run = _read_run(record(tmp_path, extra, timeout_s=RUN_TIMEOUT_S, env=train_env()), tmp_path)
    _assert_proof_holds(run, sizes={"world": 4, "tp": 2, "dp": 2, "dp_cp": 2})
    train = run["metrics"]["train"]
    assert all(e["perf/wake_create_groups_s"] > 0 for e in train[1:])  # re-created, not kept
    assert all(math.isfinite(e["train/loss"]) and e["train/grad_norm"] > 0 for e in train)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_skipped_collective_in_the_real_step_breaks_the_proof(issue_run, tmp_path):
    """skip_collective@3: rank 3 drops the first collective of its forward/backward (the recording's first
    rollout replayed on 4 ranks as CP4: a group of more than two, so the proof can tell which member
    deviated). The run stops with a named error and one hang table, and its recorded sequences (as far as
    each rank got) name rank 3 on its CP group."""
    replay = ["--load-debug-rollout-data", str(issue_run["out"] / "rollout_{rollout_id}.pt"), "--num-rollout", "1",
              "--debug-train-only", "--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "1",
              "--rollout-num-gpus-per-engine", "1"]  # no engines run; one may not span more GPUs than 4
    fence_timeout = 30
    proc = record(tmp_path, replay, timeout_s=RUN_TIMEOUT_S, fence_timeout=fence_timeout,
                  env=train_env({"SLIME_FAULT_INJECT": "skip_collective@3#0"}))
    assert_named_stop(proc, phase=r"actor_train/step\d+/|loss_token_total|forward_backward", rank=3,
                      fence_timeout_s=fence_timeout, tables=1)
    report = check_order(read_sequences(str(tmp_path / "ledger")), complete=False)
    assert not report.ok
    assert {r for m in report.mismatches for r in m.ranks} == {3}, report.format()
    on_cp = [m for m in report.mismatches if m.group == "cp[0,1,2,3]"]
    assert on_cp and "actor_train/forward_backward" in on_cp[0].detail, report.format()
