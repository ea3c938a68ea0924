"""Fully-async rollout (upstream's module path): a background generator that keeps the engines busy across
rollouts and weight pushes.

    --rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async

The first call starts one generator per process, on the rollout loop (slime/rollout/sglang_rollout.py). It
draws one prompt group at a time from the data source and generates it with `generate_and_rm_group` (so
--custom-generate-function-path and --custom-rm-path apply), keeping up to `capacity` groups in flight or
finished-and-waiting: the in-flight cap of the engines (--sglang-server-concurrency x engines, in groups),
at most two rollouts' worth. Each call of the rollout function takes the first --rollout-batch-size finished
groups, the rest wait for the next call.

Weight pushes: train_async.py holds the generator for each push (slime/rollout/generation_gate.py); the
requests the engines were running come back aborted. An aborted group goes back to the data source: with
--partial-rollout as it is, so it continues from its tokens under the new weights (its samples then list
both versions in `weight_versions`; --mask-offpolicy-in-partial-rollout keeps the earlier tokens out of
the loss), otherwise as the fresh prompt it was drawn as, so it is generated again and no sample mixes
versions.

Staleness: a group's version is the oldest weight version in its samples; its staleness is the engines'
version when it is taken minus that. `--max-weight-staleness N` drops groups staler than N (counted in
`rollout/staleness/dropped_groups`); every taken group's staleness is logged (`rollout/staleness/max`,
`rollout/staleness/mean`), with `rollout/staleness/multi_version_frac` (samples continued across a push).

Saved state: every group drawn and not yet taken (in flight or finished-and-waiting) is registered with the
data source as outstanding, as it was drawn; the data source saves it with its position, both under its lock,
so a run killed at any moment and resumed with --load generates those prompts again: none is lost, none is
trained twice (slime/rollout/data_source.py).

Deadlines: a call waits at most the rollout's deadline (slime/utils/deadlines.py; the rollout manager's
guard watches it too); every request keeps its own timeout, also between calls, when no rollout runs.
A group whose generation failed goes back to the data source as it was drawn (generated again later) and
fails the next call once, naming the error; the call after it goes on. A generator that failed itself fails
the call at once with its traceback; the next call starts a new generator, which takes over what the failed
one held. Groups a failing call had already taken stay waiting for the next one. With --use-fault-tolerance,
requests sent between calls are retried as inside one (slime/ray/rollout_manager/guard.py).
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import threading
import time
import traceback
from collections import deque
from typing import Any

from slime.rollout import generation_gate
from slime.rollout.train_data import flatten_groups
from slime.rollout.base_types import RolloutFnTrainOutput
from slime.config.run_config import run_config_of
from slime.utils.deadlines import rollout_deadline_s
from slime.rollout.metrics import compute_rollout_metrics
from slime.rollout.sampling_loop import engine_urls
from slime.rollout.sglang_rollout import (
    GenerateState,
    concurrency,
    eval_rollout,
    generate_and_rm_group,
    run,
    sampling_params,
    spawn,
)
from slime.rollout.staleness import group_version
from slime.utils.deadlines import ENGINE_HTTP_CONTROL_S
from slime.utils.http_utils import get
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

POLL_S = 0.05

_generator: "FullyAsyncGenerator | None" = None
_generator_lock = threading.Lock()


class FullyAsyncGenerator:
    """The background generator (see the module docstring)."""

    def __init__(self, args, data_source) -> None:
        self.args = args
        self.data_source = data_source
        groups_in_flight = max(1, concurrency(args) // max(1, args.n_samples_per_prompt))
        self.capacity = min(groups_in_flight, 2 * int(args.rollout_batch_size))
        self.ready: deque[list] = deque()  # finished groups, oldest first (appended by the loop's thread)
        self.in_flight = 0
        self.failed: list[BaseException] = []  # errors of groups whose generation failed, not yet raised
        self.requeued = {"redone": 0, "continued": 0, "failed": 0}
        self.drawn: dict[int, list[Sample]] = {}  # key -> the group as drawn, from its draw until it is taken
        self._ready_keys: deque[int] = deque()  # the key of each group in `ready`, in the same order
        self._keys = itertools.count()
        self._stop = False
        self._lock = _source_lock(data_source)
        track = getattr(data_source, "track_outstanding", None)
        if track is not None:
            track(lambda: [self.drawn[key] for key in sorted(self.drawn, key=lambda k: _index(self.drawn[k]))])
        else:
            logger.warning("%s has no track_outstanding(): groups drawn by the fully-async generator and not yet "
                           "trained are not in its saved state, so a resumed run skips them", type(data_source).__name__)
        self._future = spawn(self._run())

    def adopt(self, previous: "FullyAsyncGenerator") -> None:
        """Take over what a stopped generator held: its finished groups wait here, the ones it had in flight
        are generated again from their prompts."""
        with self._lock:
            for group, key in zip(previous.ready, previous._ready_keys):
                self._add_ready(group, previous.drawn.pop(key, None))
            if previous.drawn:  # in flight, or failed
                self.data_source.add_samples(list(previous.drawn.values()))
            previous.ready.clear()
            previous._ready_keys.clear()
            previous.drawn.clear()

    def _add_ready(self, group: list, drawn: list[Sample] | None, *, first: bool = False) -> None:
        key = next(self._keys)
        if drawn is not None:
            self.drawn[key] = drawn
        (self.ready.appendleft if first else self.ready.append)(group)
        (self._ready_keys.appendleft if first else self._ready_keys.append)(key)

    def stop(self) -> None:
        self._stop = True

    async def _run(self) -> None:
        tasks: dict[asyncio.Task, int] = {}  # task -> its key in self.drawn
        params = sampling_params(self.args)
        GenerateState(self.args)  # the semaphore is made on this loop
        while not self._stop:
            while not generation_gate.is_held() and self.in_flight + len(self.ready) < self.capacity:
                with self._lock:  # drawn and registered in one step: a save sees both or neither
                    drawn = self.data_source.get_samples(1)
                    for group in drawn:
                        key = next(self._keys)
                        self.drawn[key] = copy.deepcopy(group)
                        tasks[asyncio.ensure_future(generate_and_rm_group(self.args, group, dict(params)))] = key
                        self.in_flight += 1
                if not drawn:
                    break
            if not tasks:
                await asyncio.sleep(POLL_S)
                continue
            done, _ = await asyncio.wait(list(tasks), timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                with self._lock:
                    self._file(task, tasks.pop(task))

    def _file(self, task: asyncio.Task, key: int) -> None:
        self.in_flight -= 1
        drawn = self.drawn.pop(key)
        if task.exception() is not None:  # back to the source as drawn; the next call raises the error once
            self.data_source.add_samples([drawn])
            self.requeued["failed"] += 1
            self.failed.append(task.exception())
            return
        group = task.result()
        if not any(s.status == Sample.Status.ABORTED for s in flatten_groups(group)):
            self._add_ready(group, drawn)  # outstanding until taken
            return
        if self.args.partial_rollout and all(isinstance(s, Sample) for s in group):
            self.data_source.add_samples([group])  # continues from its tokens
            self.requeued["continued"] += 1
        else:
            self.data_source.add_samples([drawn])  # generated again from its prompt
            self.requeued["redone"] += 1

    def _failure(self) -> tuple[str, BaseException] | None:
        """What failed, and its error: the generator itself (its loop ended: every call until a new one takes
        over) or groups' generations (each raised once, then forgotten); None while all is well."""
        if self._future.done() and self._future.exception() is not None:
            return "the generator", self._future.exception()
        with self._lock:
            failed, self.failed = self.failed, []
        if not failed:
            return None
        where = "a group's generation" if len(failed) == 1 else f"{len(failed)} groups' generations"
        return f"{where} (its prompts went back to the data source)", failed[0]

    def _pop_ready(self) -> tuple[list, list[Sample] | None]:
        """The oldest finished group and its drawn copy, no longer outstanding (the trainer has it now)."""
        with self._lock:
            return self.ready.popleft(), self.drawn.pop(self._ready_keys.popleft(), None)

    def take(self, count: int, *, current_version: int | None, max_staleness: int | None,
             deadline: float) -> tuple[list[list], list[int], int]:
        """`count` finished groups within their staleness bound: (groups, their staleness, groups dropped)."""
        kept, staleness, dropped = [], [], 0
        try:
            while len(kept) < count:
                self._raise_failure()
                if not self.ready:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"fully-async rollout: {len(kept)} of {count} groups within the rollout's "
                                           f"deadline ({self.in_flight} in flight)")
                    time.sleep(POLL_S)
                    continue
                group, drawn = self._pop_ready()
                version = group_version(flatten_groups(group))
                stale = 0 if current_version is None or version is None else current_version - version
                if max_staleness is not None and stale > max_staleness:
                    dropped += 1
                    continue
                kept.append((group, drawn))
                staleness.append(stale)
        except BaseException:
            self._put_back(kept)
            raise
        return [group for group, _ in kept], staleness, dropped

    def _put_back(self, kept: list[tuple[list, list[Sample] | None]]) -> None:
        """A take that fails leaves what it had taken waiting, first in line, outstanding again."""
        with self._lock:
            for group, drawn in reversed(kept):
                self._add_ready(group, drawn, first=True)

    def _raise_failure(self) -> None:
        found = self._failure()
        if found is None:
            return
        where, failure = found
        trace = "".join(traceback.format_exception(failure))
        raise RuntimeError(f"fully-async rollout: {where} failed: {type(failure).__name__}: {failure}\n"
                           f"{trace}") from failure


def generator(args, data_source) -> FullyAsyncGenerator:
    """The process's generator, started on first use (again after one that ended, taking over its groups)."""
    global _generator
    with _generator_lock:
        if _generator is None or _generator._future.done():
            logger.info("starting the fully-async rollout generator")
            previous, _generator = _generator, FullyAsyncGenerator(args, data_source)
            if previous is not None:
                _generator.adopt(previous)
        return _generator


def _source_lock(data_source):
    """The data source's lock (slime/rollout/data_source.py); a custom source without one gets its own."""
    lock = getattr(data_source, "lock", None)
    return lock if lock is not None else threading.RLock()


async def _engines_version(args) -> int | None:
    """The newest weight version behind the router (engines that never got a push report none). An engine that
    does not answer (one restarting under --use-fault-tolerance) is left out; the call fails only when none does."""
    urls = await engine_urls(args)
    replies = await asyncio.gather(*(get(f"{url.rstrip('/')}/model_info", timeout_s=ENGINE_HTTP_CONTROL_S)
                                     for url in urls), return_exceptions=True)
    answered = [r for r in replies if not isinstance(r, BaseException)]
    if urls and not answered:
        raise replies[0]
    for url, reply in zip(urls, replies):
        if isinstance(reply, BaseException):
            logger.warning("fully-async rollout: engine %s did not report its weight version (%s)", url, reply)
    versions = [int(r["weight_version"]) for r in answered if str(r.get("weight_version")).isdigit()]
    return max(versions) if versions else None


def _index(group: list) -> int:
    first = flatten_groups(group)[0]
    return first.index if first.index is not None else -1


def generate_rollout_fully_async(args, rollout_id: int, data_source, evaluation: bool = False) -> Any:
    """`--rollout-function-path` entry point: --rollout-batch-size groups from the background generator."""
    if evaluation:  # on the rollout loop, beside the generator's requests
        return run(eval_rollout(args, rollout_id))
    start = time.monotonic()
    worker = generator(args, data_source)
    current = run(_engines_version(args))
    max_staleness = args.max_weight_staleness
    groups, staleness, dropped = worker.take(int(args.rollout_batch_size), current_version=current,
                                             max_staleness=max_staleness, deadline=start + rollout_deadline_s(args, run_config_of(args)))
    groups.sort(key=_index)
    samples = flatten_groups(groups)
    metrics = {**compute_rollout_metrics(args, samples),
               "rollout/staleness/max": float(max(staleness)), "rollout/staleness/mean": sum(staleness) / len(staleness),
               "rollout/staleness/dropped_groups": float(dropped),
               "rollout/fully_async/redone_groups": float(worker.requeued["redone"]),
               "rollout/fully_async/continued_groups": float(worker.requeued["continued"]),
               "rollout/fully_async/failed_groups": float(worker.requeued["failed"]),
               "rollout/fully_async/waiting_groups": float(len(worker.ready))}
    logger.info("fully-async rollout %d: %d groups in %.1fs (engines at version %s, staleness max %d, %d dropped, "
                "%d waiting)", rollout_id, len(groups), time.monotonic() - start, current, max(staleness), dropped,
                len(worker.ready))
    return RolloutFnTrainOutput(samples=groups, metrics=metrics)
