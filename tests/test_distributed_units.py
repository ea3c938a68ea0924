"""Single-process tests of slime.distributed: fault specs, hashes, ledger files, hang reports, watchdog."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from slime.distributed import (
    HANG_EXIT_CODE,
    HangError,
    Ledger,
    Watchdog,
    instrument_collectives,
    parse_fault_specs,
    plan_fingerprint,
    stable_hash,
    uninstrument_collectives,
)
from slime.distributed.fault_inject import FaultSpec, apply_metric_key_fault, apply_plan_fault, fault_active, reset_fault_cache
from slime.distributed.fence import _differing_fields, _odd_ranks
from slime.distributed.hang_report import lagging_ranks, render_hang_report, suspect_ranks


def test_fault_spec_parsing():
    assert parse_fault_specs(None) == ()
    assert parse_fault_specs("stall_logging@0") == (FaultSpec("stall_logging", 0, None),)
    assert parse_fault_specs("diverge_plan@3#2, skip_collective@1") == (
        FaultSpec("diverge_plan", 3, 2),
        FaultSpec("skip_collective", 1, None),
    )
    with pytest.raises(ValueError, match="unknown fault kind 'nap'"):
        parse_fault_specs("nap@1")
    with pytest.raises(ValueError, match="cannot parse"):
        parse_fault_specs("diverge_plan:3")


def test_fault_active_reads_env_once(monkeypatch):
    monkeypatch.setenv("SLIME_FAULT_INJECT", "extra_metric_key@2#5")
    reset_fault_cache()
    try:
        assert fault_active("extra_metric_key", 2, 5)
        assert not fault_active("extra_metric_key", 2, 4)
        assert not fault_active("extra_metric_key", 1, 5)
        assert apply_metric_key_fault(["b", "a"], 2, 5) == ("a", "b", "fault_injected/extra_metric")
        assert apply_metric_key_fault(["b", "a"], 1, 5) == ("a", "b")
        assert apply_plan_fault({"num_micro_batches": 2}, 2, 5) == {"num_micro_batches": 2}
        monkeypatch.setenv("SLIME_FAULT_INJECT", "diverge_plan@0")
        assert not fault_active("diverge_plan", 0)  # parsed once: later env changes are ignored
    finally:
        reset_fault_cache()


def test_stable_hash_and_fingerprint():
    assert stable_hash({"a": 1, "b": (1, 2)}) == stable_hash({"b": [1, 2], "a": 1})
    assert stable_hash(0.1 + 0.2) != stable_hash(0.3)
    assert stable_hash(torch.tensor([1, 2])) == stable_hash([1, 2])
    fp = plan_fingerprint({"mb": [[0, 1], [2]]}, rollout_id=3, step_id=0, micro_batch_tokens=[10, 5],
                          loss_token_total=12, metric_keys=["z", "a"])
    assert fp.num_micro_batches == 2 and fp.metric_keys == ("a", "z")
    assert fp.as_fields()["plan_hash"] == stable_hash({"mb": [[0, 1], [2]]})


def _payload(rank_fields: dict, phase="plan", seq=1) -> dict:
    return {"phase": phase, "seq": seq, "digests": {k: stable_hash(v) for k, v in rank_fields.items()}}


def test_fence_comparison_finds_the_odd_rank_and_field():
    same = [_payload({"n": 2, "keys": ["loss"]}) for _ in range(4)]
    assert _differing_fields(same) == []
    odd = list(same)
    odd[2] = _payload({"n": 3, "keys": ["loss"]})
    assert _differing_fields(odd) == ["n"]
    assert _odd_ranks(odd, ["n"]) == (2,)
    skipped = list(same)
    skipped[1] = _payload({"n": 2, "keys": ["loss"]}, phase="metrics", seq=2)
    assert _differing_fields(skipped) == ["phase", "seq"]
    assert _odd_ranks(skipped, ["phase", "seq"]) == (1,)


class _LateWork:
    """A gloo work whose op finishes just after a slice of wait(timeout) ran out, as c10d's Work does it:
    the timed wait raises "Operation timed out!" and is_completed() is true by the time it is asked."""

    def __init__(self, op_error: Exception | None = None):
        self.op_error = op_error
        self.completed = False

    def wait(self, timeout=None):
        if timeout is not None and not self.completed:
            self.completed = True
            raise RuntimeError("Operation timed out!")
        if self.op_error is not None:
            raise self.op_error
        return True

    def is_completed(self) -> bool:
        return self.completed


def test_fence_wait_accepts_an_op_that_completes_as_its_slice_runs_out():
    from slime.distributed.fence import Fence

    fence = Fence(object(), rank=0, world_size=2, timeout_s=60.0)
    fence._wait(_LateWork(), 60.0)  # completed: not mistaken for a failed op
    with pytest.raises(RuntimeError, match="Connection closed by peer"):  # a failed op keeps its own error
        fence._wait(_LateWork(RuntimeError("Connection closed by peer")), 60.0)


def _snap(rank: int, counts: dict, blocked: str | None = None, ranks=(), op_name="all_reduce", shape=()) -> dict:
    seq = sum(counts.values())
    op = {"seq": seq, "op": op_name, "group": blocked, "ranks": list(ranks), "shape": list(shape), "dtype": "float32",
          "start": time.time() - 5, "error": None}
    return {"rank": rank, "phase": "p", "seq": seq, "updated": time.time(), "in_flight": op if blocked else None,
            "blocked_on": op if blocked else None, "group_counts": counts, "recent": [op] if blocked else []}


def test_suspects_name_the_rank_that_skipped_an_op():
    # rank 3 skipped cp and waits in dp_cp; 1,5,7 wait in cp for it; 0,2,4,6 wait at the fence
    cp, dp_cp, fence = "cp[1,3,5,7]", "dp_cp[1,3,5,7]", "fence[0,1,2,3,4,5,6,7]"
    snaps = {}
    for r in (0, 2, 4, 6):
        snaps[r] = _snap(r, {fence: 2}, "fence", range(8))
    for r in (1, 5, 7):
        snaps[r] = _snap(r, {fence: 1, cp: 1}, "cp", (1, 3, 5, 7))
    snaps[3] = _snap(3, {fence: 1, dp_cp: 1}, "dp_cp", (1, 3, 5, 7))
    assert suspect_ranks(snaps) == (3,)
    assert set(lagging_ranks(snaps)) == {1, 3, 5, 7}


@pytest.mark.parametrize("recorded", ["hang_skip_gloo2", "hang_skip_nccl2"])
def test_suspects_name_the_rank_whose_op_differs_at_the_same_position(recorded):
    # CP2, rank 1 skipped a forward all-gather (skip_collective). gloo: rank 1 waits in the backward
    # reduce-scatter, level with rank 0 on cp (58 ops each); its own history breaks the tie (an
    # all-gather followed that all-gather before, a reduce-scatter never did). NCCL (2 x H200): no rank
    # is inside a host-side call, both went on; rank 1's later ops sit one position early on cp.
    recorded = os.path.join(os.path.dirname(__file__), recorded)  # the ledger files of that run
    snaps = {r: json.loads(Path(recorded, f"rank{r}.json").read_text()) for r in (0, 1)}
    assert suspect_ranks(snaps) == (1,)
    report = render_hang_report(recorded, 2)
    assert ("op mismatch on cp[0,1] #58: rank 0 all_gather_into_tensor[1024,2,32], "
            "rank 1 reduce_scatter_tensor[512,2,32]") in report
    assert "suspects): [1]" in report


def test_op_mismatch_blames_the_minority_or_names_all_on_an_undecided_tie():
    tp, cp = "tp[0,1,2]", "cp[0,1]"
    snaps = {r: _snap(r, {tp: 7}, "tp", (0, 1, 2), shape=(8,)) for r in (0, 2)}
    snaps[1] = _snap(1, {tp: 7}, "tp", (0, 1, 2), op_name="all_gather_into_tensor", shape=(8,))
    assert suspect_ranks(snaps) == (1,)
    # two members, no history to say which one left its pattern: both, not a guess
    tie = {0: _snap(0, {cp: 3}, "cp", (0, 1), shape=(4,)), 1: _snap(1, {cp: 3}, "cp", (0, 1), shape=(2,))}
    assert suspect_ranks(tie) == (0, 1)
    # a send pairs with a recv: not a mismatch
    p2p = {0: _snap(0, {cp: 3}, "cp", (0, 1), op_name="isend"), 1: _snap(1, {cp: 3}, "cp", (0, 1), op_name="irecv")}
    assert suspect_ranks(p2p) == ()


def test_ledger_file_and_report(tmp_path):
    ledger = Ledger(0, 2, str(tmp_path), flush_interval_s=0.01)
    with ledger.phase("actor_train"):
        with ledger.record("all_reduce", None, (4,), "float32"):
            pass
        entry = ledger.begin_named("fence:plan", "fence", (0, 1), (4096,), "uint8")
        ledger.flush()
        data = json.loads((tmp_path / "rank0.json").read_text())
        assert data["in_flight"]["op"] == "fence:plan" and data["phase"] == "actor_train"
        assert data["group_counts"] == {"world[]": 1, "fence[0,1]": 1}
        ledger.end(entry)
    assert ledger.signature() == [("actor_train", "all_reduce", "world", (4,)), ("actor_train", "fence:plan", "fence", (4096,))]
    report = render_hang_report(str(tmp_path), 2)
    assert "<no ledger file>" in report and "suspects): [1]" in report
    ledger.close()


@pytest.fixture
def single_rank_world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    uninstrument_collectives()
    dist.destroy_process_group()


def test_instrumentation_records_megatron_aliases(single_rank_world, tmp_path):
    from megatron.core.tensor_parallel import mappings

    ledger = Ledger(0, 1, None)
    instrument_collectives(ledger)
    x = torch.ones(2)
    dist.all_reduce(x)
    out = torch.empty(2)
    with warnings.catch_warnings():  # torch 2.13's deprecated aliases are called without a warning per call
        warnings.simplefilter("error", FutureWarning)
        mappings.dist_all_gather_func(out, x)  # bound by megatron at import time
        dist.reduce_scatter_tensor(torch.empty(2), x)
    dist.all_gather_object([None], {"k": 1})  # internally all_gather: recorded once, as the outer op
    ops = [op for _, op, _, _ in ledger.signature()]
    assert ops == ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_object"]
    assert dist.P2POp(dist.isend, x, 0).op is dist.isend  # P2POp's identity check accepts the wrapper
    # the hot path keeps torch.Size / torch.dtype; readers and the file see plain values
    snapshot = json.loads(json.dumps(ledger.snapshot()))
    first = snapshot["recent"][0]
    assert (first["op"], first["group"], first["ranks"], first["shape"], first["dtype"]) == (
        "all_reduce", "world", [0], [2], "float32")
    assert snapshot["group_counts"] == {"world[0]": 4}


def test_watchdog_raises_hang_error_in_stalled_thread(tmp_path):
    ledger = Ledger(0, 1, str(tmp_path))
    watchdog = Watchdog(0.5, str(tmp_path), 0, 1, ledger=ledger, grace_s=2.0)
    start = time.monotonic()
    with pytest.raises(HangError, match=r"HANG: phase=actor_train/logging stuck ranks=\[0\]") as raised:
        with ledger.phase("actor_train"), watchdog.phase("logging"):
            while time.monotonic() - start < 10:
                time.sleep(0.01)
    assert time.monotonic() - start < 5
    assert raised.value.lagging_ranks == (0,)  # the ranks blamed, as fields: what a restart counts
    assert "HANG: phase=actor_train/logging" in (tmp_path / "stacks_rank0.txt").read_text()
    watchdog.close()
    ledger.close()


def test_watchdog_exits_when_thread_is_blocked_in_native_code(tmp_path):
    script = textwrap.dedent(
        f"""
        import threading
        from slime.distributed import Ledger, Watchdog
        ledger = Ledger(0, 1, {str(tmp_path)!r})
        watchdog = Watchdog(0.5, {str(tmp_path)!r}, 0, 1, ledger=ledger, grace_s=0.5)
        with watchdog.phase("weight_sync"):
            threading.Event().wait()  # a lock wait: an async exception cannot land here
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)  # imports megatron: slow on a loaded box
    assert proc.returncode == HANG_EXIT_CODE
    assert "HANG: phase=weight_sync stuck ranks=[0]" in proc.stderr
    assert "Thread" in (tmp_path / "stacks_rank0.txt").read_text()  # faulthandler stacks
