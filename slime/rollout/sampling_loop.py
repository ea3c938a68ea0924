"""Over-sampling, dynamic filtering and partial rollout: how the default rollout collects its groups.

Groups are drawn `--over-sampling-batch-size` at a time (default `--rollout-batch-size`) whenever the
groups still in play (in flight or kept) fall short of `--rollout-batch-size`. Each finished group goes
through `--dynamic-sampling-filter-path` (DAPO: drop groups whose rewards are all equal); the first
`--rollout-batch-size` kept groups form the rollout. The groups still in flight are then aborted on
every engine (`/abort_request`): with `--partial-rollout` they are collected, half-generated, for the
data source's buffer and resumed by a later rollout; without it they are dropped.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from slime.rollout.train_data import flatten_groups
from slime.rollout.filter_hub.base_types import DropCounter, call_dynamic_filter, should_drop_dynamic_filter_output
from slime.router.workers import RouterWorkers
from slime.utils.deadlines import ENGINE_HTTP_CONTROL_S
from slime.utils.http_utils import post
from slime.utils.misc import load_function
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

# A filter that rejects (nearly) every group would otherwise draw prompts forever.
MAX_SAMPLING_ROUNDS = 64
# While in-flight groups drain after an abort, the engines are told again at this period (a request
# that reached an engine just after the previous abort would otherwise run to its length limit).
ABORT_POLL_S = 1.0

GroupFn = Callable[[Any, list[Sample], dict], Awaitable[list]]


@dataclass
class SamplingResult:
    kept_groups: list[list[Sample]]
    """The rollout: --rollout-batch-size groups in prompt order."""
    all_groups: list[list[Sample]]
    """Every group that finished, kept or dropped, in prompt order."""
    aborted_groups: list[list[Sample]]
    """With --partial-rollout: the groups that were in flight, for the data source's buffer."""
    drops: DropCounter = field(default_factory=DropCounter)
    drawn_groups: int = 0
    rounds: int = 0

    def metrics(self, args) -> dict[str, float]:
        """The sampling metrics of the features that are on (dynamic filter, over-sampling, partial rollout)."""
        out: dict[str, float] = {}
        if args.dynamic_sampling_filter_path:
            out.update(self.drops.metrics())
        if args.dynamic_sampling_filter_path or args.over_sampling_batch_size:
            out.update({"rollout/sampling/drawn_groups": float(self.drawn_groups),
                        "rollout/sampling/rounds": float(self.rounds)})
        if args.partial_rollout:
            aborted = flatten_groups(self.aborted_groups)
            out.update({"rollout/partial/buffered_groups": float(len(self.aborted_groups)),
                        "rollout/partial/buffered_tokens": float(sum(s.response_length for s in aborted))})
        return out


def _first_index(group: list) -> int:
    first = flatten_groups(group)[0]
    return first.index if first.index is not None else -1


class SamplingLoop:
    """One rollout's collection of groups (see the module docstring); `state.aborted` stops new requests."""

    def __init__(self, args, rollout_id: int, *, generate_group: GroupFn, state, drain_timeout_s: float) -> None:
        self.args = args
        self.drain_timeout_s = drain_timeout_s
        self.rollout_id = rollout_id
        self.generate_group = generate_group
        self.state = state
        self.target = int(args.rollout_batch_size)
        self.batch = int(args.over_sampling_batch_size or self.target)
        path = args.dynamic_sampling_filter_path
        self.filter = load_function(path) if path else None

    async def run(self, draw: Callable[[int], list[list[Sample]]], params: dict) -> SamplingResult:
        result = SamplingResult(kept_groups=[], all_groups=[], aborted_groups=[])
        pending: set[asyncio.Task] = set()
        candidates = 0  # groups in flight or kept
        try:
            while len(result.kept_groups) < self.target:
                while candidates < self.target:
                    groups = self._draw(draw, result)
                    pending |= {asyncio.ensure_future(self.generate_group(self.args, g, dict(params))) for g in groups}
                    candidates += len(groups)
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: _first_index(t.result())):
                    candidates -= self._take(task.result(), result, candidates)
            result.aborted_groups = await self._abort(pending)
            pending = set()
        finally:
            await _cancel(pending)
            self.state.aborted = False  # generate_and_rm may be called again (eval, a custom rollout function)
        result.kept_groups.sort(key=_first_index)
        result.all_groups.sort(key=_first_index)
        return result

    def _draw(self, draw, result: SamplingResult) -> list[list[Sample]]:
        if result.rounds >= MAX_SAMPLING_ROUNDS:
            raise RuntimeError(
                f"dynamic sampling kept {len(result.kept_groups)} of --rollout-batch-size {self.target} groups after "
                f"{result.rounds} rounds of --over-sampling-batch-size {self.batch} ({result.drawn_groups} groups; "
                f"dropped: {dict(result.drops.reasons)}): --dynamic-sampling-filter-path "
                f"{self.args.dynamic_sampling_filter_path} rejects nearly every group")
        groups = draw(self.batch)
        if not groups:
            raise RuntimeError("the data source returned no prompts; check --prompt-data / --data-source-path")
        result.rounds += 1
        result.drawn_groups += len(groups)
        return groups

    def _take(self, group: list, result: SamplingResult, candidates: int) -> int:
        """File a finished group; returns 1 when it stops being a candidate (dropped), else 0."""
        result.all_groups.append(group)
        verdict = call_dynamic_filter(self.filter, self.args, group)
        if should_drop_dynamic_filter_output(verdict, remaining_batch_size=candidates, target_data_size=self.target):
            result.drops.drop(verdict.reason)
            return 1
        if len(result.kept_groups) < self.target:
            result.kept_groups.append(group)
        return 0

    async def _abort(self, pending: set[asyncio.Task]) -> list[list[Sample]]:
        """Stop the groups still in flight; with --partial-rollout return them (partly generated)."""
        self.state.aborted = True
        if not pending:
            return []
        if not self.args.partial_rollout:
            await _cancel(pending)
            await abort_engines(self.args)  # nobody waits for those requests any more
            return []
        deadline = time.monotonic() + self.drain_timeout_s
        collected: list[list[Sample]] = []
        while pending:
            await abort_engines(self.args)
            done, pending = await asyncio.wait(pending, timeout=ABORT_POLL_S)
            collected += [task.result() for task in done]
            if pending and time.monotonic() > deadline:
                await _cancel(pending)
                raise TimeoutError(f"partial rollout: {len(pending)} aborted groups did not come back within "
                                   f"{self.drain_timeout_s:.0f}s")
        resumable = [g for g in collected if not any(isinstance(item, list) for item in g)]
        if len(resumable) < len(collected):  # several samples per prompt cannot be resumed as one sample
            logger.warning("rollout %d: %d aborted groups hold multi-sample results and are dropped, not buffered",
                           self.rollout_id, len(collected) - len(resumable))
        collected = resumable
        for sample in flatten_groups(collected):
            if sample.response_length and "start_rollout_id" not in sample.metadata:
                sample.metadata["start_rollout_id"] = self.rollout_id
        collected.sort(key=_first_index)
        logger.info("rollout %d: %d in-flight groups aborted and kept for a later rollout", self.rollout_id,
                    len(collected))
        return collected


async def _cancel(tasks: set[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


async def engine_urls(args) -> list[str]:
    """The engines behind the router, as the router lists them (each router kind has its own route)."""
    router = RouterWorkers.for_args(args)
    return await asyncio.to_thread(router.urls)


async def abort_engines(args) -> None:
    """SGLang's /abort_request with abort_all on every engine: in-flight requests end with finish 'abort'."""
    urls = await engine_urls(args)
    await asyncio.gather(*(post(f"{url.rstrip('/')}/abort_request", {"abort_all": True},
                                timeout_s=ENGINE_HTTP_CONTROL_S) for url in urls))
