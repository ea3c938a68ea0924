"""Eager, deadline-bounded first use of every communicator a training step will touch.

Run in the wake fence so that no communicator is created lazily inside actor_train (the likeliest
cause of upstream issue #1487). Order is fixed and identical on every rank. CP ring pairs are warmed
in both directions with pairwise-matched posting (even ring index sends first, odd receives first):
an all-send-first order deadlocks NCCL's lazily created two-rank communicators. Odd-sized rings use
batch_isend_irecv, whose posting order does not matter. Batched p2p is warmed too (TE uses it on
older GPUs), so both p2p paths have their communicators.
"""
from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from slime.distributed.errors import WarmupTimeoutError
from slime.distributed.fault_inject import maybe_stall
from slime.distributed.group_names import group_label
from slime.distributed.ledger import Ledger
from slime.distributed.progress import suspects

# (name, getter) in the fixed warm-up order; getters that are not initialised are skipped on every rank alike.
GROUP_GETTERS: tuple[tuple[str, Callable[[], object]], ...] = (
    ("world", lambda: dist.group.WORLD),
    ("tp", mpu.get_tensor_model_parallel_group),
    ("cp", mpu.get_context_parallel_group),
    ("dp", mpu.get_data_parallel_group),
    ("dp_cp", lambda: mpu.get_data_parallel_group(with_context_parallel=True)),
    ("mp", mpu.get_model_parallel_group),
    ("tp_cp", mpu.get_tensor_and_context_parallel_group),
    ("tp_dp_cp", lambda: mpu.get_tensor_and_data_parallel_group(with_context_parallel=True)),
    ("pp", mpu.get_pipeline_model_parallel_group),
    ("embd", mpu.get_embedding_group),
    ("ep", mpu.get_expert_model_parallel_group),
    ("etp", mpu.get_expert_tensor_parallel_group),
    ("edp", mpu.get_expert_data_parallel_group),
    # the MoE dispatcher's token counts and routing maps (megatron's pg_collection.tp_ep), the experts' grad norm
    ("tp_ep", mpu.get_expert_tensor_and_model_parallel_group),
    ("tp_ep_pp", mpu.get_expert_tensor_model_pipeline_parallel_group),
)
# Warmed only under expert parallelism: a dense model never uses them, and on NCCL each warmed group of
# several ranks holds a communicator's memory (docs/debugging.md: an MoE model at EP 1 creates them at first use).
EXPERT_ONLY_GROUPS = frozenset({"tp_ep", "tp_ep_pp"})


def step_groups() -> list[tuple[str, object]]:
    """The initialised groups of the step, in warm-up order (same names on every rank)."""
    groups = []
    for name, getter in GROUP_GETTERS:
        try:
            group = getter()
        except (AssertionError, RuntimeError):
            continue
        if group is not None and not isinstance(group, list):
            groups.append((name, group))
    return groups


def warmed_groups() -> list[tuple[str, object]]:
    """The groups the warm-up touches, in order: every step group, the experts' compound ones under EP > 1."""
    experts = mpu.get_expert_model_parallel_world_size() > 1
    return [(name, group) for name, group in step_groups() if experts or name not in EXPERT_ONLY_GROUPS]


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    ops: tuple[str, ...]  # e.g. "all_reduce tp[0,1]", "p2p_fwd cp[0,2,4,6]"


class CommunicatorWarmup:
    """`run()` issues one tiny op per group plus both CP ring directions, each bounded by timeout_s."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        ledger: Ledger | None = None,
        rollout_id: int | None = None,
    ):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.ledger = ledger
        self.rollout_id = rollout_id
        self.device = _device()

    def run(self) -> WarmupReport:
        start = time.perf_counter()
        ops: list[str] = []
        for name, group in warmed_groups():
            self._wait(f"all_reduce {group_label(group)}", group, [dist.all_reduce(self._probe(), group=group, async_op=True)])
            ops.append(f"all_reduce {group_label(group)}")
        maybe_stall("stall_comm_init", self.rank, self.rollout_id)  # reproduces a rank stuck in comm setup
        ops += self._warm_cp_ring()
        return WarmupReport(time.perf_counter() - start, tuple(ops))

    def _probe(self) -> torch.Tensor:
        return torch.ones(1, device=self.device)

    def _warm_cp_ring(self) -> list[str]:
        if mpu.get_context_parallel_world_size() == 1:
            return []
        group = mpu.get_context_parallel_group()
        ring = mpu.get_context_parallel_global_ranks()
        ops = []
        for direction, step in (("p2p_fwd", 1), ("p2p_bwd", -1)):
            label = f"{direction} {group_label(group)}"
            self._wait(label, group, self._ring_exchange(ring, step, group))
            ops.append(label)
        label = f"p2p_batched {group_label(group)}"
        self._wait(label, group, self._batched_exchange(ring, group))
        ops.append(label)
        return ops

    def _ring_exchange(self, ring: list[int], step: int, group: object) -> list:
        """Single isend/irecv to ring neighbours, posted in even/odd order (matched pairs)."""
        index = ring.index(self.rank)
        send_to, recv_from = ring[(index + step) % len(ring)], ring[(index - step) % len(ring)]
        if len(ring) % 2:
            return self._batched_pair(send_to, recv_from, group)
        send_buf, recv_buf = self._probe(), self._probe()
        if index % 2 == 0:
            send = dist.isend(send_buf, dst=send_to, group=group)
            recv = dist.irecv(recv_buf, src=recv_from, group=group)
        else:
            recv = dist.irecv(recv_buf, src=recv_from, group=group)
            send = dist.isend(send_buf, dst=send_to, group=group)
        return [send, recv]

    def _batched_exchange(self, ring: list[int], group: object) -> list:
        index = ring.index(self.rank)
        return self._batched_pair(ring[(index + 1) % len(ring)], ring[(index - 1) % len(ring)], group)

    def _batched_pair(self, send_to: int, recv_from: int, group: object) -> list:
        ops = [
            dist.P2POp(dist.isend, self._probe(), send_to, group),
            dist.P2POp(dist.irecv, self._probe(), recv_from, group),
        ]
        return dist.batch_isend_irecv(ops)

    def _wait(self, label: str, group: object, works: list) -> None:
        """Wait with a deadline; the wait is a ledger op so a hang report shows who blocks where."""
        recording = self.ledger.record("wait", group) if self.ledger else contextlib.nullcontext()
        try:
            with recording:
                _wait_completed(works, group, self.timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            # files as the peers left them (ours still shows this wait in flight: it is <0.1 s stale);
            # the table of every rank is rendered once, by the driver or the hang_report command
            lagging = suspects(self.ledger, self.world_size)
            phase = self.ledger.current_phase if self.ledger else "warmup"
            raise WarmupTimeoutError(
                f"communicator warm-up '{label}' in phase {phase} on rank {self.rank} did not complete within "
                f"{self.timeout_s:g}s; lagging ranks={list(lagging)}; cause: {str(exc)[:300]}",
                phase=phase,
                lagging_ranks=lagging,
            ) from exc


def _wait_completed(works: list, group: object, timeout_s: float, poll_s: float = 0.001) -> None:
    """Block the host until every op has finished, or raise at the deadline.

    gloo's `work.wait(timeout)` blocks the host with that deadline. NCCL's only orders the current
    stream after the op and returns at once, so it bounds nothing on the host and lets the next
    warm-up op overlap this one: there completion is polled instead (gloo's p2p works, in turn, only
    complete inside wait(), so polling is NCCL-only).
    """
    if dist.get_backend(group) != "nccl":
        for work in works:
            work.wait(timeout=timedelta(seconds=timeout_s))
        return
    deadline = time.monotonic() + timeout_s
    for work in works:
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"op not completed within {timeout_s:g}s")
            time.sleep(poll_s)
        work.wait()  # surfaces the op's own error, if any


def _device() -> torch.device:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
