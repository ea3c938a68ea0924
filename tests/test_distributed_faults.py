"""Each stall class, injected on one rank of 8 (TP2 x CP4), ends in a named error inside the deadline.

Faults target rollout 1, after a clean rollout 0 and a sleep/wake. Fence and warm-up deadlines are
FENCE_S; the watchdog deadline WATCHDOG_S is longer, so ranks that can time out by themselves do,
and the watchdog catches the rest (a Python-level stall gets HangError; a rank blocked in native
code exits with code 3 after printing the HANG line).
"""
from __future__ import annotations

import pytest

import distributed_workers as workers
from mp_utils import run_ranks_outcomes
from slime.distributed import HANG_EXIT_CODE

WORLD = 8
FENCE_S = 8.0
WATCHDOG_S = 12.0


def _run(tmp_path, monkeypatch, spec: str, expert_parallel: int = 1):
    monkeypatch.setenv("SLIME_FAULT_INJECT", spec)
    return run_ranks_outcomes(workers.fault_run, WORLD, args=(str(tmp_path), FENCE_S, WATCHDOG_S, expert_parallel),
                              timeout_s=240)


def _error(outcome) -> dict:
    assert outcome.status == "ok", f"rank {outcome.rank}: {outcome.status} {outcome.exitcode} {outcome.value}"
    assert outcome.value["error"] is not None, f"rank {outcome.rank} finished without an error"
    return outcome.value


@pytest.mark.timeout(300)
def test_rank_stuck_in_communicator_warmup(tmp_path, monkeypatch):
    outcomes = _run(tmp_path, monkeypatch, "stall_comm_init@3#1")
    stuck = _error(outcomes[3])
    assert stuck["error"] == "HangError" and "HANG: phase=wake stuck ranks=[3]" in stuck["message"]
    for outcome in outcomes[:3] + outcomes[4:]:
        err = _error(outcome)
        assert "FenceTimeoutError" in err["mro"], err
        assert "lagging ranks=[3]" in err["message"] and "wake" in err["message"], err["message"]


@pytest.mark.timeout(300)
def test_rank_skipping_a_collective(tmp_path, monkeypatch):
    outcomes = _run(tmp_path, monkeypatch, "skip_collective@3#1")
    for rank in (0, 2, 4, 6):  # their CP group is complete: they reach the metrics fence and time out there
        err = _error(outcomes[rank])
        assert err["error"] == "FenceTimeoutError" and "fence 'metrics'" in err["message"]
        assert "lagging ranks=[3]" in err["message"], err["message"]
    hang_line = "HANG: phase=actor_train/forward_backward stuck ranks=[3]"
    for rank in (1, 3, 5, 7):  # blocked inside gloo ops: the watchdog reports, then raises or exits
        outcome = outcomes[rank]
        if outcome.status == "exit":  # still blocked in native code after the grace period
            assert outcome.exitcode == HANG_EXIT_CODE, outcome
        else:  # the op returned (a peer's exit closed its connection) and HangError landed
            assert _error(outcome)["error"] == "HangError" and hang_line in outcome.value["message"]
        assert hang_line in (tmp_path / f"stacks_rank{rank}.txt").read_text().splitlines()[0]


@pytest.mark.timeout(300)
def test_rank_stuck_in_logging(tmp_path, monkeypatch):
    outcomes = _run(tmp_path, monkeypatch, "stall_logging@0#1")
    stuck = _error(outcomes[0])
    assert stuck["error"] == "HangError" and "HANG: phase=actor_train/logging stuck ranks=[0]" in stuck["message"]
    for outcome in outcomes[1:]:
        err = _error(outcome)
        assert err["error"] == "FenceTimeoutError" and "fence 'step_end'" in err["message"]
        assert "lagging ranks=[0]" in err["message"], err["message"]


# ------------------------------------------------------------------ expert parallelism: TP2 x EP4


@pytest.mark.timeout(300)
def test_ep_rank_stuck_in_communicator_warmup(tmp_path, monkeypatch):
    """The EP, ETP and expert-DP groups are warmed with the others: a rank stuck there is named at wake."""
    outcomes = _run(tmp_path, monkeypatch, "stall_comm_init@5#1", expert_parallel=4)
    stuck = _error(outcomes[5])
    assert stuck["error"] == "HangError" and "HANG: phase=wake stuck ranks=[5]" in stuck["message"]
    for outcome in outcomes[:5] + outcomes[6:]:
        err = _error(outcome)
        assert "FenceTimeoutError" in err["mro"] and "lagging ranks=[5]" in err["message"], err["message"]


@pytest.mark.timeout(300)
def test_ep_rank_skipping_its_token_all_to_all(tmp_path, monkeypatch):
    """An EP rank that skips the dispatch all-to-all (uneven token counts): its EP peers block inside it and the
    watchdog names the phase and the rank; the others time out at the next fence naming it too."""
    import re

    outcomes = _run(tmp_path, monkeypatch, "skip_collective@3#1", expert_parallel=4)
    hang = re.compile(r"HANG: phase=actor_train/forward_backward stuck ranks=\[([\d, ]+)\]")

    def names_rank_3(text: str) -> bool:
        match = hang.search(text) or re.search(r"lagging ranks=\[([\d, ]+)\]", text)
        return bool(match) and 3 in [int(r) for r in match.group(1).split(",")]

    for outcome in outcomes:
        if outcome.status == "exit":  # blocked in native code after the grace period: the HANG line is on file
            assert outcome.exitcode == HANG_EXIT_CODE, outcome
            continue
        err = _error(outcome)
        assert err["error"] in ("HangError", "FenceTimeoutError") and names_rank_3(err["message"]), err["message"]
    stacks = [p.read_text().splitlines()[0] for p in tmp_path.glob("stacks_rank*.txt")]
    assert stacks and all(hang.match(line) and names_rank_3(line) for line in stacks), stacks
