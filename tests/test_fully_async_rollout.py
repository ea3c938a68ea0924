"""The fully-async generator's own logic (slime/rollout/fully_async_rollout.py) with a stand-in per-group generate:
what happens to groups aborted by a weight push, the staleness bound, the gate, a failed group. The real engines
run it in tests/test_train_async_e2e.py."""
from __future__ import annotations

import asyncio
import time

import torch

import pytest

from rollout_testing import tokenizer_dir  # noqa: F401 (fixture)
from slime.rollout import fully_async_rollout as fa
from slime.rollout import generation_gate
from slime.utils.types import Sample


class Source:
    def __init__(self):
        self.drawn = 0
        self.buffer: list[list[Sample]] = []

    def get_samples(self, n):
        if self.buffer:
            return [self.buffer.pop(0)]
        self.drawn += 1
        return [[Sample(index=2 * self.drawn + i, prompt=f"p{self.drawn}") for i in range(2)]]

    def add_samples(self, groups):
        self.buffer += groups


def _args(**flags):
    from slime.config import defaults_namespace

    return defaults_namespace(**{"rollout_batch_size": 2, "n_samples_per_prompt": 2, "sglang_server_concurrency": 2,
                                 "rollout_num_gpus": 2, "rollout_num_gpus_per_engine": 1, "partial_rollout": False,
                                 **flags})


def _generated(sample: Sample, version: int, status=Sample.Status.COMPLETED) -> Sample:
    sample.response_length, sample.status = 3, status
    sample.weight_versions.append(str(version))
    return sample


@pytest.fixture
def worker(monkeypatch):
    made = []

    def start(args, source, plan):
        async def fake_group(args, group, params, evaluation=False):
            await asyncio.sleep(0.01)
            return plan(group)

        monkeypatch.setattr(fa, "generate_and_rm_group", fake_group)
        monkeypatch.setattr(fa, "sampling_params", lambda args: {})
        monkeypatch.setattr(fa, "GenerateState", lambda args: None)
        made.append(fa.FullyAsyncGenerator(args, source))
        return made[-1]

    yield start
    for w in made:
        w.stop()
    generation_gate.release()


def _take(w, count, **kw):
    return w.take(count, current_version=kw.pop("current", None), max_staleness=kw.pop("max_staleness", None),
                  deadline=time.monotonic() + 10)


def test_groups_aborted_by_a_push_are_redone_from_their_prompt(worker):
    source, calls = Source(), []

    def plan(group):
        calls.append([s.response_length for s in group])
        status = Sample.Status.ABORTED if len(calls) == 1 else Sample.Status.COMPLETED
        return [_generated(s, 0, status) for s in group]

    w = worker(_args(), source, plan)
    groups, staleness, dropped = _take(w, 2)
    assert len(groups) == 2 and dropped == 0 and w.requeued == {"redone": 1, "continued": 0, "failed": 0}
    assert all(c == [0, 0] for c in calls)  # the aborted group came back as the fresh prompt it was drawn as
    assert all(s.weight_versions == ["0"] for g in groups for s in g)  # one version per sample


def test_with_partial_rollout_an_aborted_group_continues_from_its_tokens(worker):
    source, calls = Source(), []

    def plan(group):
        calls.append([s.response_length for s in group])
        return [_generated(s, len(calls) - 1, Sample.Status.ABORTED if len(calls) == 1 else Sample.Status.COMPLETED)
                for s in group]

    w = worker(_args(partial_rollout=True), source, plan)
    groups, _, _ = _take(w, 3)  # the two first drawn (one of them continued) and one more
    assert w.requeued["continued"] == 1 and [3, 3] in calls  # resumed with what it had
    continued = [s for g in groups for s in g if len(s.weight_versions) == 2]
    assert len(continued) == 2 and all(s.weight_versions[0] == "0" != s.weight_versions[1] for s in continued)


def test_groups_staler_than_the_bound_are_dropped_and_counted(worker):
    versions = iter([3, 4, 5, 3, 5, 5, 5, 5, 5, 5])
    w = worker(_args(rollout_batch_size=3), Source(), lambda group: [_generated(s, v) for s, v in
                                                                      zip(group, [next(versions)] * 2)])
    groups, staleness, dropped = _take(w, 3, current=5, max_staleness=1)
    assert dropped == 2 and staleness == [1, 0, 0]


def test_a_held_gate_draws_no_new_prompt(worker):
    generation_gate.hold()
    source = Source()
    w = worker(_args(), source, lambda group: [_generated(s, 0) for s in group])
    time.sleep(0.3)
    assert source.drawn == 0 and w.in_flight == 0
    generation_gate.release()
    assert len(_take(w, 2)[0]) == 2


def test_a_failed_group_fails_one_call_its_prompt_goes_back_and_the_next_call_goes_on(worker):
    source, calls = Source(), []

    def plan(group):
        calls.append(group[0].prompt)
        if len(calls) == 1:
            raise ConnectionError("router went away")
        return [_generated(s, 0) for s in group]

    w = worker(_args(), source, plan)
    with pytest.raises(RuntimeError, match="a group's generation .*ConnectionError: router went away"):
        _take(w, 2)
    groups, _, _ = _take(w, 2)  # the error was raised once; the failed prompt was generated again
    assert sorted(g[0].prompt for g in groups) == ["p1", "p2"] and calls.count("p1") == 2
    assert w.requeued["failed"] == 1 and source.drawn >= 2
    assert all(g[0].prompt != "p1" for g in w.drawn.values())  # no longer outstanding twice


def test_the_engines_version_leaves_out_an_engine_that_does_not_answer(monkeypatch):
    replies = {"http://a": ConnectionError("restarting"), "http://b": {"weight_version": "3"}}

    async def urls(args):
        return list(replies)

    async def get(url, timeout_s):
        reply = replies[url.removesuffix("/model_info")]
        if isinstance(reply, BaseException):
            raise reply
        return reply

    monkeypatch.setattr(fa, "engine_urls", urls)
    monkeypatch.setattr(fa, "get", get)
    assert asyncio.run(fa._engines_version(_args())) == 3
    replies["http://b"] = ConnectionError("down too")
    with pytest.raises(ConnectionError, match="restarting"):
        asyncio.run(fa._engines_version(_args()))


def test_version_metrics_name_the_oldest_version_of_each_sample():
    from slime.rollout.staleness import group_version, version_metrics

    fresh, continued, unpushed = Sample(weight_versions=["4"]), Sample(weight_versions=["3", "4"]), \
        Sample(weight_versions=["default"])
    assert group_version([fresh, continued, unpushed]) == 3
    assert version_metrics([fresh, continued, unpushed]) == {
        "rollout/weight_version_min": 3.0, "rollout/weight_version_max": 4.0,
        "rollout/staleness/multi_version_frac": 1 / 3}
    assert version_metrics([unpushed]) == {}  # an engine that never got a push reports no version


# ----- the saved data state, the generator's own failure ------------------------------------------------------
PROMPTS = [{"prompt": f"what is {i} + 1 ?", "label": str(i + 1)} for i in range(40)]


def _source(tokenizer_dir, prompts, **flags):
    from slime.config import defaults_namespace
    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    args = defaults_namespace(prompt_data=str(prompts), hf_checkpoint=tokenizer_dir, input_key="prompt",
                              label_key="label", rollout_shuffle=True, seed=7, n_samples_per_prompt=2,
                              rollout_batch_size=2, sglang_server_concurrency=4, rollout_num_gpus=2,
                              rollout_num_gpus_per_engine=1, partial_rollout=False, **flags)
    return args, RolloutDataSourceWithBuffer(args)


def _labels(groups) -> list[str]:
    return [group[0]["label"] if isinstance(group[0], dict) else group[0].label for group in groups]


def test_a_run_killed_mid_generation_resumes_losing_and_repeating_no_prompt(worker, tokenizer_dir, tmp_path):
    """Rollout 0 is taken and the data state saved while groups are in flight and waiting; the run is then killed
    (every object dropped) during rollout 1. The resumed run trains rollouts 1-3: no prompt is trained twice, and
    every prompt the data position passed is trained or still outstanding at the end."""
    from rollout_testing import write_jsonl

    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    slow = lambda group: time.sleep(0.02) or [_generated(s, 0) for s in group]  # noqa: E731
    args, source = _source(tokenizer_dir, prompts, save=str(tmp_path / "ckpt"))
    w = worker(args, source, slow)
    trained = _labels(_take(w, 2)[0])
    time.sleep(0.1)  # the generator refills: groups in flight and finished, not taken
    source.save(0)
    saved = torch.load(source.state_path(str(tmp_path / "ckpt"), 0), weights_only=True)
    assert len(saved["outstanding"]) >= 2, saved["outstanding"]  # what the generator held is in the state
    _take(w, 2)  # rollout 1 of the killed run: never trained, never saved
    w.stop()

    args, resumed = _source(tokenizer_dir, prompts, load=str(tmp_path / "ckpt"))
    resumed.load(0)
    w = worker(args, resumed, slow)
    for _ in range(3):
        trained += _labels(_take(w, 2)[0])
    w.stop()
    time.sleep(0.1)
    with resumed.lock:
        outstanding = _labels(resumed.state_dict()["outstanding"]) + _labels(resumed.buffer)
    order = resumed._epoch_order()[:resumed.sample_offset]
    passed = [PROMPTS[i]["label"] for i in order]
    assert len(trained) == len(set(trained)) == 8, trained
    assert sorted(trained + outstanding) == sorted(passed), (trained, outstanding, passed)


def test_the_generators_own_failure_fails_the_call_at_once_with_its_traceback(worker):
    """get_samples raises inside the generator's loop: the waiting call fails at once (not at its deadline) with
    the traceback, keeps the groups it had taken waiting, and a new generator takes them over."""
    class Failing(Source):
        def get_samples(self, n):
            if self.drawn == 2:
                raise KeyError("prompt row vanished")
            return super().get_samples(n)

    source = Failing()
    w = worker(_args(), source, lambda group: [_generated(s, 0) for s in group])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the generator failed: KeyError") as raised:
        w.take(4, current_version=None, max_staleness=None, deadline=time.monotonic() + 60)
    assert time.monotonic() - start < 5
    assert "Traceback" in str(raised.value) and "in get_samples" in str(raised.value)
    assert len(w.ready) == 2 and len(w.drawn) == 2  # the two finished groups still wait, still outstanding
    source.drawn = 3  # the source recovered
    successor = worker(_args(), source, lambda group: [_generated(s, 0) for s in group])
    successor.adopt(w)
    taken, _, _ = successor.take(2, current_version=None, max_staleness=None, deadline=time.monotonic() + 10)
    assert sorted(g[0].prompt for g in taken) == ["p1", "p2"]  # finished in either order


def test_the_generator_draws_under_the_data_sources_lock(worker, tokenizer_dir, tmp_path):
    from rollout_testing import write_jsonl

    args, source = _source(tokenizer_dir, write_jsonl(tmp_path / "p.jsonl", PROMPTS))
    with source.lock:  # as the manager's save holds it
        w = worker(args, source, lambda group: [_generated(s, 0) for s in group])
        time.sleep(0.3)
        assert w.in_flight == 0 and not w.ready and source.sample_offset == 0
    assert len(_take(w, 2)[0]) == 2
