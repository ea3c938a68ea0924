"""Each hang class, injected on one rank of the product's own step, ends in a named error naming the phase and
the rank.

The ranks run slime's MegatronTrainActor (tests/step_ranks.py) on forked gloo ranks, with the fault aimed at
rollout 1, after a clean rollout 0 and a colocated sleep, so it meets a woken step. --fence-timeout is
FENCE_S: a rank that can time out by itself does, and the watchdog catches the rest (a Python-level stall
gets HangError; a rank blocked in native code exits with the hang code after writing the HANG line to the
ledger dir). Through train.py and its driver: a diverging plan (tests/test_end_to_end.py), a skipped
collective (tests/test_order_proof.py), engines killed and stalled (tests/test_engine_faults_e2e.py).
"""
from __future__ import annotations

import pytest

import step_ranks
from mp_utils import run_ranks_outcomes
from slime.distributed import HANG_EXIT_CODE
from tiny_models import save_tiny_qwen3, save_tiny_qwen3_moe
from train_step_harness import make_rollout

pytestmark = pytest.mark.ranks

WORLD = 4
FENCE_S = 8.0
TP2_SP_CP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2"]
# A CP group of four: a rank that skips an op on it is told apart from the peer it was paired with.
CP4 = ["--context-parallel-size", "4"]
TP2_SP_EP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("step_faults")
    return {"dense": save_tiny_qwen3(str(root / "qwen3")), "moe": save_tiny_qwen3_moe(str(root / "qwen3_moe"))}


def run_step(tmp_path, monkeypatch, checkpoint: str, layout: list[str], fault: str, rollouts: int = 2):
    """Every rank's outcome per rollout (a list), or the rank's exit when it never reported."""
    monkeypatch.setenv("SLIME_FAULT_INJECT", fault)
    args = step_ranks.step_args(checkpoint, world=WORLD, extra=layout, fence_timeout=FENCE_S)
    return run_ranks_outcomes(step_ranks.train_rollouts, WORLD, init_process_group=False, timeout_s=240,
                              args=(args, str(tmp_path), make_rollout(8), rollouts))


def rollout_outcomes(outcome, rollouts: int) -> list[dict]:
    assert outcome.status == "ok", f"rank {outcome.rank}: {outcome.status} {outcome.exitcode} {outcome.value}"
    assert len(outcome.value) == rollouts, f"rank {outcome.rank}: {outcome.value}"
    first = outcome.value[0]
    assert first["error"] is None and first["metrics"]["train/grad_norm"] > 0, first  # rollout 0 trained
    return outcome.value


def error_in_rollout_1(outcome) -> dict:
    error = rollout_outcomes(outcome, 2)[1]
    assert error["error"] is not None, f"rank {outcome.rank} finished rollout 1 without an error"
    return error


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,layout", [("dense", TP2_SP_CP2), ("moe", TP2_SP_EP2)])
def test_rank_stuck_in_communicator_warmup(checkpoints, tmp_path, monkeypatch, model, layout):
    """stall_comm_init@3: rank 3 never finishes warming its communicators (the EP groups too, on the MoE model)
    when it wakes for rollout 1: it is named stuck in actor_train/wake, its peers name it lagging."""
    outcomes = run_step(tmp_path, monkeypatch, checkpoints[model], layout, "stall_comm_init@3#1")
    stuck = error_in_rollout_1(outcomes[3])
    assert stuck["error"] == "HangError" and "HANG: phase=actor_train/wake stuck ranks=[3]" in stuck["message"]
    for outcome in outcomes[:3]:
        error = error_in_rollout_1(outcome)
        assert "FenceTimeoutError" in error["mro"] and error["ranks"] == [3], error
        assert "wake" in error["phase"] and "lagging ranks=[3]" in error["message"], error["message"]


@pytest.mark.timeout(300)
def test_diverging_plan_and_extra_metric_key_raise_on_every_rank_together(checkpoints, tmp_path, monkeypatch):
    """diverge_plan@3 in rollout 1, extra_metric_key@1 in rollout 2: every rank raises the same divergence
    error at the plan fence, then at the exit fence, naming the rank and the fields; the ranks raise
    together, so rollout 3 trains again on all of them."""
    outcomes = run_step(tmp_path, monkeypatch, checkpoints["dense"], TP2_SP_CP2,
                        "diverge_plan@3#1,extra_metric_key@1#2", rollouts=4)
    for outcome in outcomes:
        _, plan, metric, last = rollout_outcomes(outcome, 4)
        assert plan["error"] == "CollectiveDivergenceError" and plan["phase"] == "actor_train/plan", plan
        assert plan["ranks"] == [3] and {"num_micro_batches", "plan_hash"} <= set(plan["fields"]), plan
        assert "ranks [3] diverge at fence 'actor_train/plan'" in plan["message"]
        assert metric["error"] == "CollectiveDivergenceError" and metric["phase"] == "actor_train/exit", metric
        assert metric["ranks"] == [1] and metric["fields"] == ["metric_keys"], metric
        assert "fault_injected/extra_metric" in metric["message"]
        assert last["error"] is None and last["metrics"]["train/grad_norm"] > 0, last


@pytest.mark.timeout(300)
def test_rank_skipping_a_collective(checkpoints, tmp_path, monkeypatch):
    """skip_collective@3: rank 3 drops the first collective of its forward/backward; every rank ends blocked in
    gloo or with the watchdog's error, and the HANG line each writes names the phase and rank 3 alone."""
    outcomes = run_step(tmp_path, monkeypatch, checkpoints["dense"], CP4, "skip_collective@3#1")
    hang_line = "HANG: phase=actor_train/forward_backward stuck ranks=[3]"
    for outcome in outcomes:
        if outcome.status == "exit":  # blocked in native code after the grace period: the HANG line is on file
            assert outcome.exitcode == HANG_EXIT_CODE, outcome
        else:  # the op returned (a peer's exit closed its connection) and the watchdog's error landed
            error = error_in_rollout_1(outcome)
            assert error["error"] == "HangError" and hang_line in error["message"], error
        assert (tmp_path / f"stacks_rank{outcome.rank}.txt").read_text().splitlines()[0].startswith(hang_line)


@pytest.mark.timeout(300)
def test_rank_stuck_in_logging(checkpoints, tmp_path, monkeypatch):
    """stall_logging@0: rank 0's log line after the exit fence never returns. Rank 0 names its logging phase;
    the others, already at the colocated sleep's fence, name rank 0 lagging there."""
    outcomes = run_step(tmp_path, monkeypatch, checkpoints["dense"], TP2_SP_CP2, "stall_logging@0#1")
    stuck = error_in_rollout_1(outcomes[0])
    assert stuck["error"] == "LoggingStallError", stuck
    assert f"phase=actor_train/logging rank=0: logging did not finish within {FENCE_S:g}s" in stuck["message"]
    for outcome in outcomes[1:]:
        error = error_in_rollout_1(outcome)
        assert error["error"] == "FenceTimeoutError" and error["phase"] == "sleep" and error["ranks"] == [0], error
        assert "lagging ranks=[0]" in error["message"], error["message"]
