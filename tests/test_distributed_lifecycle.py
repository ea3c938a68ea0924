"""Sleep/wake with --recreate-process-groups-on-wake: 20 destroy + re-create + warm-up cycles, no stall, no leak."""
from __future__ import annotations

import pytest

import distributed_workers as workers
from mp_utils import run_ranks_outcomes

pytestmark = pytest.mark.ranks

WORLD = 8
CYCLES = 20


@pytest.mark.timeout(480)
def test_twenty_recreate_cycles_without_stall(tmp_path):
    outcomes = run_ranks_outcomes(workers.recreate_cycles, WORLD, args=(str(tmp_path), CYCLES), timeout_s=420)
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, "\n".join(f"rank {o.rank}: {o.status} {o.exitcode} {o.value}" for o in bad)
    values = [o.value for o in outcomes]
    for value in values:
        assert value["recreated"] == [True] * CYCLES
        assert value["groups_stable"]
        assert len(value["warmups"]) == CYCLES and all(w > 0 for w in value["warmups"])
        assert {"tp", "cp", "dp", "dp_cp", "mp", "tp_cp"} <= set(value["regrouped"][0])
    assert len({v["fence_seq"] for v in values}) == 1
