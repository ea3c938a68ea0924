"""A user hook that rewrites the batch differently on one rank ends as a CollectiveDivergenceError naming the rank.

--rollout-data-postprocess-path and --custom-advantage-function-path run on every rank; whenever one is set,
every rank fences the keys it changed and their digests (slime/backends/megatron_utils/hook_fence.py); with
DP > 1 the per-DP keys (advantages, log-probs, ...) among the ranks of each DP rank. The product's own step runs
on forked gloo ranks (tests/step_ranks.py); the digest and scope rules are checked in-process.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import hook_plugins
import step_ranks
from mp_utils import run_ranks_outcomes
from slime.backends.megatron_utils.hook_fence import PerDpKeys, run_fenced_hook, value_digest
from slime.distributed.fence import ScopedFields
from slime.utils.rollout_batch import PER_DP_RANK_KEYS
from tiny_models import save_tiny_qwen3
from train_step_harness import make_rollout

PLUGINS = str(Path(hook_plugins.__file__).resolve())


class RecordingFence:
    def __init__(self):
        self.calls = []

    def __call__(self, phase, fields, scoped=None):
        self.calls.append((phase, dict(fields), scoped))


def test_fence_names_what_the_hook_changed_and_scopes_per_dp_keys_to_the_dp_rank():
    data = make_rollout(4)
    data["log_probs"] = [[-0.5] * n for n in data["response_lengths"]]
    fence = RecordingFence()

    def hook():
        data["loss_masks"][1][0] = 1 - data["loss_masks"][1][0]
        data["log_probs"][0][0] = -9.0  # per DP rank: out of the digest
        data["extra"] = [1, 2]

    changed = run_fenced_hook(fence, "actor_train/postprocess", 3, data, hook,
                              per_dp=PerDpKeys(PER_DP_RANK_KEYS, dp_rank=1))
    assert changed == {"loss_masks", "extra"}  # what every rank agrees on
    ((phase, fields, scoped),) = fence.calls
    assert phase == "actor_train/postprocess" and fields["rollout_id"] == 3
    assert fields["changed_keys"] == ["extra", "loss_masks"] and fields["removed_keys"] == []
    assert fields["value/loss_masks"] == value_digest(data["loss_masks"])
    assert not any("log_probs" in key for key in fields)  # compared among DP rank 1's ranks only
    assert scoped == ScopedFields("dp1", {"dp_changed_keys": ["log_probs"], "dp_removed_keys": [],
                                          "value/log_probs": value_digest(data["log_probs"])})
    # a hook that changes nothing still fences (the peers cannot know it did nothing); DP 1: every key world-wide
    assert run_fenced_hook(fence, "actor_train/postprocess", 4, data, lambda: None) == frozenset()
    assert fence.calls[-1][1]["changed_keys"] == [] and fence.calls[-1][2] is None


def test_value_digest_sees_every_number_and_every_row_boundary():
    rows = [[1, 2, 3], [0.25, -1.0]]
    assert value_digest(rows) == value_digest([[1, 2, 3], [0.25, -1.0]])
    assert value_digest(rows) != value_digest([[1, 2], [3, 0.25, -1.0]])  # same numbers, other samples
    assert value_digest(rows) != value_digest([[1, 2, 3], [0.25, -1.0 + 1e-12]])
    assert value_digest([["a"], ["b"]]) != value_digest([["a"], ["c"]])  # not numbers: the generic encoding


@pytest.mark.ranks
@pytest.mark.timeout(240)
def test_rank_local_hooks_end_as_divergence_naming_the_rank(tmp_path):
    """TP2 x DP2 on four ranks. Rollout 0: rank 1's postprocess hook masks one more token; rollout 1: rank 1's
    advantage hook scales one sample's advantages, which its TP peer (rank 0, the same DP rank) does not; rollout
    2: the ranks of DP rank 1 scale one sample's advantages, those of DP rank 0 do not (per-DP values may differ
    between DP ranks). Every rank raises the same error together, naming rank 1, the phase and the key, and
    trains rollout 2."""
    checkpoint = save_tiny_qwen3(str(tmp_path / "qwen3"))
    args = step_ranks.step_args(checkpoint, world=4, fence_timeout=30, extra=[
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--rollout-data-postprocess-path", f"{PLUGINS}:rank_local_postprocess",
        "--custom-advantage-function-path", f"{PLUGINS}:rank_local_advantages"])
    outcomes = run_ranks_outcomes(step_ranks.train_rollouts, 4, init_process_group=False, timeout_s=200,
                                  args=(args, str(tmp_path / "ledger"), make_rollout(8), 3))
    for outcome in outcomes:
        assert outcome.status == "ok", outcome
        postprocess, advantages, dp_only = outcome.value
        assert postprocess["error"] == "CollectiveDivergenceError", postprocess
        assert postprocess["phase"] == "actor_train/postprocess" and postprocess["ranks"] == [1], postprocess
        assert {"changed_keys", "value/loss_masks"} <= set(postprocess["fields"]), postprocess
        assert advantages["error"] == "CollectiveDivergenceError", advantages
        assert advantages["phase"] == "actor_train/custom_advantages" and advantages["ranks"] == [1], advantages
        assert "value/advantages" in advantages["fields"], advantages
        assert "within their scope" in advantages["message"], advantages
        assert dp_only["error"] is None and dp_only["metrics"]["train/grad_norm"] > 0, dp_only


def _payload(scope, **scoped):
    return {"phase": "p", "seq": 1, "digests": {}, "scope": scope, "scoped": scoped}


def test_scoped_fields_are_compared_within_each_scope_only():
    from slime.distributed.fence import _differing_scoped_fields, _odd_scoped_ranks

    agree_within = [_payload("dp0", a="x"), _payload("dp0", a="x"), _payload("dp1", a="y"), _payload("dp1", a="y")]
    assert _differing_scoped_fields(agree_within) == []
    split = [_payload("dp0", a="x"), _payload("dp0", a="z"), _payload("dp1", a="y"), _payload("dp1", a="y")]
    assert _differing_scoped_fields(split) == ["a"] and _odd_scoped_ranks(split, ["a"]) == (1,)
    missing = [_payload("dp0", a="x"), _payload("dp0"), _payload("dp1", a="y"), _payload("dp1", a="y")]
    assert _differing_scoped_fields(missing) == ["a"] and _odd_scoped_ranks(missing, ["a"]) == (1,)
