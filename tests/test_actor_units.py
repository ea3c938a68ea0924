"""Pieces of the fenced rank actor that need no model: DP sharing, group re-pointing, weight snapshots."""
from __future__ import annotations

import pytest
import torch

from slime.backends.megatron_utils.actor import WeightSnapshots, repoint_process_groups, share_across_dp
from tests.mp_utils import run_ranks

pytestmark = pytest.mark.ranks


def _share_on_dp2(rank: int, world_size: int):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()  # world of 2 = DP2
    # Like compute_log_probs at DP2: each rank filled only its own samples.
    data = {"log_probs": [[float(i)] * (i + 1) if i % 2 == rank else [] for i in range(5)], "ref_log_probs": None}
    share_across_dp(data, ("log_probs", "ref_log_probs"))
    parallel_state.destroy_model_parallel()
    return data


@pytest.mark.timeout(120)
def test_share_across_dp_fills_every_sample_on_every_rank():
    results = run_ranks(_share_on_dp2, 2, timeout_s=90)
    expected = [[float(i)] * (i + 1) for i in range(5)]
    assert [r["log_probs"] for r in results] == [expected, expected]
    assert all(r["ref_log_probs"] is None for r in results)


def test_repoint_process_groups_reaches_deep_and_shared_references():
    old, new, other = object(), object(), object()

    class Layer:
        def __init__(self):
            self.tp_group = old
            self.groups = [old, {"dp": old, "keep": other}]

    deep = Layer()
    root = torch.nn.ModuleList()  # references held inside a module's __dict__ too
    root.extra = [[[[[[[[deep]]]]]]]]
    root.same_again = deep
    replaced = repoint_process_groups([root], [("tp", old, new)])
    assert replaced == 3
    assert deep.tp_group is new and deep.groups[0] is new and deep.groups[1] == {"dp": new, "keep": other}


def test_weight_snapshot_swaps_in_and_restores():
    model = torch.nn.Linear(2, 2)
    snapshots = WeightSnapshots([model])
    snapshots.take("ref")
    with torch.no_grad():
        model.weight.add_(1.0)
    trained = model.weight.detach().clone()
    with snapshots.swapped("ref"):
        assert not torch.equal(model.weight, trained)
    assert torch.equal(model.weight, trained)
    assert "ref" in snapshots and "_live" not in snapshots
