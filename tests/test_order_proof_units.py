"""Single-process tests of the recorded sequence: the ledger's sequence file, the order proof's rules, the renderer."""
from __future__ import annotations

import json
import time
from collections import deque

from slime.distributed.ledger import Ledger, ledger_path, sequence_path
from slime.distributed.order_proof import RankSequence, SequenceOp, check_order, read_sequence, read_sequences
from slime.tools.render_step_sequence import fold_repeats, phase_runs, render, rollout_windows


def _record(ledger: Ledger, ops: list[tuple[str, str, tuple[int, ...], tuple]]) -> None:
    for op, group, ranks, shape in ops:
        ledger.end(ledger.begin_named(op, group, ranks, shape, "float32"))


def test_sequence_file_keeps_every_op_once_in_order_with_positions_and_notes(tmp_path):
    ledger = Ledger(0, 2, str(tmp_path), record_sequence=True, flush_interval_s=60)
    with ledger.phase("actor_train"):
        _record(ledger, [("all_reduce", "tp", (0, 1), (4,)), ("all_gather", "cp", (0, 2), (2, 8))])
        ledger.note("fence:plan", {"micro_batches_per_step": [[1, 2]]})
        ledger.flush()
        ledger.flush()  # nothing new: nothing written twice
        in_flight = ledger.begin_named("all_reduce", "tp", (0, 1), (4,), "float32")
        ledger.flush()  # an op still in flight is written too (where a stuck rank stopped)
        ledger.end(in_flight)
    ledger.close()
    lines = [json.loads(line) for line in open(sequence_path(str(tmp_path), 0))]
    assert [(d.get("op") or d.get("note"), d.get("pos")) for d in lines] == [
        ("all_reduce", 1), ("all_gather", 1), ("fence:plan", None), ("all_reduce", 2)]
    sequence = read_sequence(sequence_path(str(tmp_path), 0), 0)
    assert [op.seq for op in sequence.ops] == [1, 2, 3]
    assert sequence.notes[0].fields == {"micro_batches_per_step": [[1, 2]]} and sequence.notes[0].after_seq == 2
    assert sequence.ops[1].shape == (2, 8) and sequence.ops[1].label == "cp[0,2]"


def test_the_window_is_trimmed_only_after_writing_so_no_op_is_lost(tmp_path):
    ledger = Ledger(0, 1, str(tmp_path), record_sequence=True, flush_interval_s=60, max_entries=10)
    _record(ledger, [("all_reduce", "world", (0,), (1,))] * 25)
    assert len(ledger.entries()) == 25  # nothing on file yet: nothing leaves memory
    ledger.flush()
    assert [e.seq for e in ledger.entries()] == list(range(16, 26))
    ledger.close()
    sequence = read_sequence(sequence_path(str(tmp_path), 0), 0)
    assert [op.seq for op in sequence.ops] == list(range(1, 26))
    assert check_order({0: sequence}).ok
    cut = RankSequence(0, sequence.ops[:5] + sequence.ops[6:], ())  # a file with a hole fails the proof
    assert "misses ops before #7" in check_order({0: cut}).format()


def test_recording_appends_the_sequence_without_rewriting_the_rank_file_each_time(tmp_path):
    """The flusher appends the sequence every SEQUENCE_FLUSH_INTERVAL_S, but the rank's file keeps its own interval
    (here 60 s: only the write at start), each rewrite being a JSON dump and a replace."""
    ledger = Ledger(0, 1, str(tmp_path), record_sequence=True, flush_interval_s=60)
    _record(ledger, [("all_reduce", "world", (0,), (1,))] * 3)
    deadline = time.monotonic() + 10
    while len(open(sequence_path(str(tmp_path), 0)).readlines()) < 3:
        assert time.monotonic() < deadline, "the flusher did not append the sequence"
        time.sleep(0.05)
    time.sleep(0.3)  # a few more ticks of the flusher
    assert json.load(open(ledger_path(str(tmp_path), 0)))["seq"] == 0
    ledger.close()
    assert json.load(open(ledger_path(str(tmp_path), 0)))["seq"] == 3


class _AppendedWhileCopied(deque):
    """The hot path's append landing between a reader making its iterator and reading it (`appends` times)."""

    appends: list = []

    def __reversed__(self):
        iterator = super().__reversed__()
        if self.appends:
            self.appends.pop()()
        return iterator


def test_an_append_during_a_copy_is_copied_again_not_raised(tmp_path):
    ledger = Ledger(0, 1, str(tmp_path), record_sequence=True, flush_interval_s=60)
    _record(ledger, [("all_reduce", "world", (0,), (1,))] * 3)
    entries = ledger._entries = _AppendedWhileCopied(ledger._entries)
    entries.appends = [lambda: _record(ledger, [("all_gather", "world", (0,), (2,))])]
    ledger.flush()  # the sequence file's copy meets the append: taken again
    entries.appends = [lambda: _record(ledger, [("broadcast", "world", (0,), (3,))])]
    assert [op["op"] for op in ledger.snapshot()["recent"]][-2:] == ["all_gather", "broadcast"]  # the rank file's
    ledger.close()
    sequence = read_sequence(sequence_path(str(tmp_path), 0), 0)
    assert [(op.seq, op.op) for op in sequence.ops] == [(1, "all_reduce"), (2, "all_reduce"), (3, "all_reduce"),
                                                        (4, "all_gather"), (5, "broadcast")]


def test_a_point_to_point_op_is_written_with_its_peers_even_if_flushed_the_moment_it_starts(tmp_path):
    """The flusher thread may write an entry as soon as it is appended: its peers must already be in it."""
    ledger = Ledger(0, 2, str(tmp_path), record_sequence=True, flush_interval_s=60)

    class FlushOnAppend(type(ledger._entries)):
        def append(self, entry):
            super().append(entry)
            ledger.flush()  # what the flusher does when it wakes up right after the append

    ledger._entries = FlushOnAppend(ledger._entries)
    ledger.end(ledger.begin_p2p("batch_isend_irecv", None, (("isend", (3,)), ("irecv", (3,))), "int64", (1, 1)))
    ledger.end(ledger.begin_p2p("isend", None, (4,), "float32", 1))
    ledger.close()
    sequence = read_sequence(sequence_path(str(tmp_path), 0), 0)
    assert [op.peer for op in sequence.ops] == [(1, 1), 1]


def test_sequence_recording_is_off_by_default(tmp_path):
    ledger = Ledger(0, 1, str(tmp_path))
    _record(ledger, [("all_reduce", "world", (0,), (1,))])
    ledger.note("fence:plan", {"a": 1})
    ledger.close()
    assert not (tmp_path / "sequence_rank0.jsonl").exists()
    assert read_sequences(str(tmp_path)) == {}


def _op(seq, op, group, ranks, shape=(4,), *, phase="actor_train/forward_backward", dtype="float32", peer=None):
    return SequenceOp(seq=seq, position=seq, phase=phase, op=op, group=group, ranks=tuple(ranks), shape=tuple(shape),
                      dtype=dtype, peer=peer)


def _sequences(per_rank: dict[int, list[tuple]]) -> dict[int, RankSequence]:
    return {rank: RankSequence(rank, tuple(_op(i + 1, *spec) if isinstance(spec, tuple) else spec
                                           for i, spec in enumerate(ops)), ())
            for rank, ops in per_rank.items()}


CP = (1, 3, 5, 7)
HEALTHY = [("all_gather_into_tensor", "cp", CP, (128, 1, 32)), ("reduce_scatter_tensor", "cp", CP, (32, 1, 32)),
           ("all_reduce", "cp", CP, (1,))]


def test_identical_sequences_pass_and_one_rank_with_another_dtype_fails():
    assert check_order(_sequences({r: HEALTHY for r in CP})).ok
    altered = list(HEALTHY)
    altered[1] = SequenceOp(seq=2, position=2, phase="actor_train/forward_backward", op="reduce_scatter_tensor",
                            group="cp", ranks=CP, shape=(32, 1, 32), dtype="bfloat16")
    report = check_order(_sequences({1: HEALTHY, 3: HEALTHY, 5: altered, 7: HEALTHY}))
    assert [(m.group, m.position, m.ranks) for m in report.mismatches] == [("cp[1,3,5,7]", 2, (5,))]


def test_a_skipped_collective_is_named_in_a_complete_run_and_in_one_that_stopped():
    tp = (2, 3)
    ops = [("all_gather_into_tensor", "tp", tp, (8,)), ("reduce_scatter_tensor", "tp", tp, (4,)),
           ("all_gather_into_tensor", "tp", tp, (8,)), ("all_reduce", "tp", tp, (2,))]
    skipped = ops[:1] + ops[2:]  # rank 3 dropped op #2 and went on: a two-member tie, broken by the shift
    for complete in (True, False):
        report = check_order(_sequences({2: ops, 3: skipped}), complete=complete)
        assert [(m.position, m.ranks) for m in report.mismatches] == [(2, (3,))], report.format()
    stopped = ops[:2]  # a run that failed: a shorter but equal prefix is no mismatch unless complete
    assert check_order(_sequences({2: ops, 3: stopped}), complete=False).ok
    assert check_order(_sequences({2: ops, 3: stopped})).mismatches[0].ranks == (3,)


def test_point_to_point_ops_are_paired_not_compared():
    ring = (0, 2)  # even posts send first, odd receive first, as the CP warm-up does: still a match
    even = [("isend", "cp", ring, (1,), {"peer": 2}), ("irecv", "cp", ring, (1,), {"peer": 2})]
    odd = [("irecv", "cp", ring, (1,), {"peer": 0}), ("isend", "cp", ring, (1,), {"peer": 0})]

    def seq(rank, specs):
        return RankSequence(rank, tuple(_op(i + 1, op, g, r, s, peer=kw["peer"])
                                        for i, (op, g, r, s, kw) in enumerate(specs)), ())

    assert check_order({0: seq(0, even), 2: seq(2, odd)}).ok
    batch = _op(1, "batch_isend_irecv", "cp", ring, (("irecv", (1,)), ("isend", (1,))), peer=(0, 0))
    batched = RankSequence(2, (batch,), ())
    assert check_order({0: seq(0, even), 2: batched}).ok
    wrong = [("irecv", "cp", ring, (2,), {"peer": 0}), ("isend", "cp", ring, (1,), {"peer": 0})]
    report = check_order({0: seq(0, even), 2: seq(2, wrong)})
    assert [m.ranks for m in report.mismatches] == [(0, 2)] and "sends" in report.format()


def test_a_member_without_a_sequence_file_fails():
    report = check_order(_sequences({1: HEALTHY, 3: HEALTHY, 5: HEALTHY}))
    assert [m.ranks for m in report.mismatches] == [(7,)]


def test_fold_repeats():
    assert fold_repeats(["a", "b", "a", "b", "c"]) == ["(a, b) x2", "c"]
    assert fold_repeats(["x", "x", "x"]) == ["x x3"]
    assert fold_repeats(["a", "b", "b", "a", "b", "b"]) == ["(a, b x2) x2"]
    assert fold_repeats(["a", "b", "c"]) == ["a", "b", "c"]


def test_render_splits_rollouts_at_each_wake_and_lists_phases_per_group():
    def ops(first_seq):
        specs = [("init/create_groups", "all_reduce", "tp"), ("actor_train/wake", "all_reduce", "tp"),
                 ("actor_train/forward_backward", "all_gather_into_tensor", "tp"),
                 ("actor_train/forward_backward", "all_gather_into_tensor", "tp"),
                 ("actor_train/forward_backward", "all_reduce", "cp"), ("sleep", "fence:sleep", "fence"),
                 ("weight_sync/push/bucket0", "all_gather", "tp"), ("actor_train/wake", "all_reduce", "tp"),
                 ("actor_train/forward_backward", "all_reduce", "cp")]
        return tuple(_op(first_seq + i, op, group, (0, 1), phase=phase) for i, (phase, op, group) in enumerate(specs))

    sequences = {r: RankSequence(r, ops(1), ()) for r in (0, 1)}
    windows = rollout_windows(sequences[0])
    assert [len(w) for w in windows] == [6, 2]
    assert [run.phase for run in phase_runs(windows[0])] == [
        "actor_train/wake", "actor_train/forward_backward", "sleep", "weight_sync/push/bucket0"]
    page = render(sequences, rollout_index=0, rank=0)
    assert "| `tp[0,1]` | all_gather_into_tensor 4 float32 x2 |" in page
    assert "| 2 | `actor_train/forward_backward` | 3 | tp, cp |" in page
    assert "every member of every group recorded the same sequence" in page


def test_a_closed_trainer_has_written_its_last_op(tmp_path):
    """The driver closes every rank before it kills it: the ops of the run's last moments (up to a flush
    interval) are on file then, so the order proof does not see one rank a fence short."""
    from slime.backends.megatron_utils.actor import MegatronTrainActor
    from slime.config import defaults_namespace

    args = defaults_namespace()
    args.ledger_record_sequence = True
    trainer = MegatronTrainActor(args, 0, 1, str(tmp_path))
    trainer.ledger.end(trainer.ledger.begin_named("fence:save", "fence", (0,), (4096,), "uint8"))
    trainer.close()  # at once: the flusher's next turn is up to 0.1 s away
    ops = read_sequence(sequence_path(str(tmp_path), 0), 0).ops
    assert [op.op for op in ops] == ["fence:save"]
