"""An EP rank that skips its token all-to-all, on the stand-in step (tests/distributed_workers.py) of 8 ranks as
TP2 x EP4: the hang report names the phase and the rank.

The other hang classes are injected into the product's own step (tests/test_step_faults.py). This one stays
on the stand-in: on the real MoE step over gloo, a rank that runs ahead into a differently sized all-to-all
aborts its process (a crash the driver reports as the rank's exit) instead of hanging.
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

pytestmark = pytest.mark.ranks

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
