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


def test_train_async_pushes_keep_what_the_engines_hold_and_push_it_back_after_a_resume():
    """update_weights(keep_served=True) keeps a copy of the pushed weights (saved as the engines' weights), a later
    push of other weights forgets it, and served=True pushes the copy while the trainer keeps its own weights."""
    import contextlib
    import types

    from slime.backends.megatron_utils.actor import MegatronTrainActor

    layer = torch.nn.Linear(2, 2, bias=False)
    pushed = []
    actor = types.SimpleNamespace(
        rank=0, asleep=False, snapshots=WeightSnapshots([layer]), served_version=None,
        groups=types.SimpleNamespace(fence=None),
        weight_sync=types.SimpleNamespace(sync=lambda model, rollout_id, **_: pushed.append(
            (rollout_id + 1, model[0].weight.detach().clone())) or {}, retarget=lambda urls: None),
        watchdog=types.SimpleNamespace(phase=lambda name: contextlib.nullcontext()),
        memory=types.SimpleNamespace(read_param=None), ledger=types.SimpleNamespace(flush=lambda: None))
    actor.model = [layer]
    push = MegatronTrainActor.update_weights.__get__(actor)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    push(3, keep_served=True)  # version 4: a save follows before the next push
    assert actor.served_version == 4 and "served" in actor.snapshots
    with torch.no_grad():
        layer.weight.fill_(2.0)  # the trainer trains on
    push(3, served=True)  # a resumed run: the engines get the copy (version 4), the trainer keeps version 5
    assert torch.equal(pushed[-1][1], torch.ones(2, 2)) and torch.equal(layer.weight, torch.full((2, 2), 2.0))
    push(4)  # a catch-up of restarted engines: the others still hold the copy
    assert actor.served_version == 4 and "served" in actor.snapshots
    push(4, keep_served=False)  # the schedule's push, no save before the next one: the copy is no longer theirs
    assert actor.served_version is None and "served" not in actor.snapshots
    assert [version for version, _ in pushed] == [4, 4, 5, 5]
