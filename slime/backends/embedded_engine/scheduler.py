"""Batching and engine-state control for the embedded engine's HTTP server.

Static batching: requests that arrive while a batch runs wait and form the next batch. One
asyncio lock serialises every use of the model (batches, weight updates, release/resume) and
one worker thread runs them, so the model is never touched concurrently.

Pause semantics: mode "abort" (SGLang's default) aborts running and queued requests; modes
"in_place"/"retract" let the running batch finish and hold queued ones until continue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from slime.backends.embedded_engine.engine import (
    EmbeddedEngine,
    EngineReleasedError,
    GenerationRequest,
    GenerationResult,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")
PAUSE_MODES = ("abort", "retract", "in_place")


class BatchScheduler:
    def __init__(self, engine: EmbeddedEngine, max_batch_size: int) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedded-engine")
        self._pending: list[tuple[GenerationRequest, asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._model_lock = asyncio.Lock()
        self._paused = False
        # Read by the worker thread between decode steps; set membership is atomic in CPython.
        self._aborted_rids: set[str] = set()
        self._running_rids: frozenset[str] = frozenset()
        self._task: asyncio.Task | None = None
        self.last_progress = time.monotonic()  # a batch started or made a decode step (/health_generate)
        # SGLang's work counters (/v1/loads): prompt tokens of every batch started, and the running batch's tokens
        # (prompts and what they generated so far: its KV cache), one more per token generated
        self.prefill_tokens = 0
        self.batch_tokens = 0

    @property
    def paused(self) -> bool:
        return self._paused

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ----- generation --------------------------------------------------------------------
    async def submit(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if self.engine.released_tags:
            raise EngineReleasedError(
                f"engine memory is released ({', '.join(self.engine.released_tags)}); "
                "call /resume_memory_occupation before /generate"
            )
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in requests]
        self._pending.extend(zip(requests, futures))
        self._wakeup.set()
        return list(await asyncio.gather(*futures))

    async def _run(self) -> None:
        while True:
            if self._paused or not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self._pending[: self.max_batch_size]
            del self._pending[: self.max_batch_size]
            await self._run_batch(batch)

    async def _run_batch(self, batch: list[tuple[GenerationRequest, asyncio.Future]]) -> None:
        requests = [request for request, _ in batch]
        async with self._model_lock:
            self._running_rids = frozenset(r.rid for r in requests)
            self.last_progress = time.monotonic()
            self.batch_tokens = sum(len(r.input_ids) for r in requests)
            self.prefill_tokens += self.batch_tokens
            try:
                results = await self._in_worker(self.engine.generate_batch, requests, self._should_abort)
            except Exception as exc:  # the requests of this batch fail, the server keeps serving
                logger.exception("generation batch failed")
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                return
            finally:
                self._aborted_rids -= self._running_rids
                self._running_rids = frozenset()
                self.batch_tokens = 0
        for (_, future), result in zip(batch, results):
            if not future.done():
                future.set_result(result)

    def _should_abort(self, rid: str) -> bool:
        self.last_progress = time.monotonic()  # called between decode steps, once per token a request generated
        self.batch_tokens += 1
        return rid in self._aborted_rids

    # ----- control -----------------------------------------------------------------------
    async def run_exclusive(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the engine thread once no batch is running (waits for the current one)."""
        async with self._model_lock:
            return await self._in_worker(fn, *args)

    async def _in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Abort running and queued requests (all, or the one with this rid); returns how many."""
        targets = {r.rid for r, _ in self._pending} | set(self._running_rids)
        if not abort_all:
            targets &= {rid}
        self._aborted_rids |= targets & set(self._running_rids)
        kept = []
        for request, future in self._pending:
            if request.rid in targets:
                future.set_result(_aborted_result(request, self.engine.weight_version))
            else:
                kept.append((request, future))
        self._pending = kept
        return len(targets)

    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; expected one of {PAUSE_MODES}")
        self._paused = True
        if mode == "abort":
            self.abort(abort_all=True)
        async with self._model_lock:  # returns once the running batch has ended
            pass
        logger.info("generation paused (mode=%s, %d queued)", mode, len(self._pending))

    def resume_generation(self) -> None:
        self._paused = False
        self._wakeup.set()
        logger.info("generation continued")

    def num_queued(self) -> int:
        return len(self._pending)

    def idle(self) -> bool:
        """No request running or waiting: nothing holds state a flush would drop."""
        return not self._pending and not self._running_rids and not self._model_lock.locked()

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.idle():
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    def request_ids(self) -> tuple[list[str], list[str]]:
        """(running, queued) request ids."""
        return sorted(self._running_rids), [request.rid for request, _ in self._pending]

    def load(self) -> dict[str, Any]:
        """This engine's entry of SGLang's /v1/loads (one DP rank), with the fields it can fill: the requests it
        holds and the work counters that move while it generates."""
        running, queued = self.request_ids()
        waiting_tokens = sum(len(request.input_ids) for request, _ in self._pending)
        return {"dp_rank": 0, "timestamp": time.time(), "num_running_reqs": len(running),
                "num_waiting_reqs": len(queued), "num_used_tokens": self.batch_tokens,
                "num_total_tokens": self.batch_tokens + waiting_tokens, "max_running_requests": self.max_batch_size,
                "total_prefill_uncached_tokens": self.prefill_tokens}


def _aborted_result(request: GenerationRequest, weight_version: str) -> GenerationResult:
    return GenerationResult(
        rid=request.rid,
        text="",
        output_ids=[],
        finish_reason={"type": "abort", "message": "request aborted before it ran"},
        prompt_tokens=len(request.input_ids),
        output_logprobs=[] if request.return_logprob else None,
        weight_version=weight_version,
    )
