"""8-rank gloo (TP2 x CP4): clean fenced steps give identical ledgers; keep-mode sleep/wake keeps the groups.

Plan and metric-key divergence on the product's own step: tests/test_step_faults.py."""
from __future__ import annotations

import pytest

import distributed_workers as workers
from mp_utils import run_ranks_outcomes

pytestmark = pytest.mark.ranks

WORLD = 8


def _p2p_as_one(signature):
    return [(phase, "p2p" if op in ("isend", "irecv") else op, group, shape) for phase, op, group, shape in signature]


def _values(outcomes):
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, "\n".join(f"rank {o.rank}: {o.status} {o.exitcode} {o.value}" for o in bad)
    return [o.value for o in outcomes]


@pytest.mark.timeout(300)
def test_clean_fenced_steps_have_identical_ledgers_and_keep_mode_cycles(tmp_path):
    values = _values(run_ranks_outcomes(workers.clean_then_keep_cycles, WORLD, args=(str(tmp_path), 2, 5), timeout_s=240))
    reference = values[0]
    for value in values:
        assert value["signatures"] == reference["signatures"]  # same ops, groups, shapes, phases on every rank
        # warm-up p2p is posted in even/odd order by design: compare it as "p2p"
        assert _p2p_as_one(value["create_signature"]) == _p2p_as_one(reference["create_signature"])
        assert value["fence_seq"] == reference["fence_seq"]
        assert value["same_groups"]  # keep mode: no group destroyed or created across sleep/wake
    step_ops = [(phase, op, group) for phase, op, group, _ in reference["signatures"][0]]
    assert step_ops == [
        ("actor_train/plan", "fence:plan", "fence"),
        ("actor_train/forward_backward", "all_reduce", "tp"),
        ("actor_train/forward_backward", "all_reduce", "cp"),
        ("actor_train/forward_backward", "all_reduce", "dp_cp"),
        ("actor_train/metrics", "fence:metrics", "fence"),
        ("actor_train/metrics", "all_reduce", "dp_cp"),
    ]
    warmup_ops = {(op, group) for _, op, group, _ in reference["create_signature"]}
    for group in ("world", "tp", "cp", "dp", "dp_cp", "mp", "tp_cp"):
        assert ("all_reduce", group) in warmup_ops, group
    assert {("isend", "cp"), ("irecv", "cp"), ("batch_isend_irecv", "cp")} <= warmup_ops
    # TP2 x CP4 sums: TP pair, then CP ring, then DP x CP (== CP here): same total on every rank
    assert len({tuple(v["totals"]) for v in values}) == 1
