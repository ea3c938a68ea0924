"""Deterministic fault injection for reproducing each hang class in tests.

SLIME_FAULT_INJECT=<kind>@<rank>[#<rollout_id>][,<kind>@<rank>...] is parsed once per process.
Without '#<rollout_id>' the fault fires in every rollout. Unset or empty: no fault ever fires.
For the engine faults (ENGINE_FAULT_KINDS) '<rank>' is the rollout engine's index; the rollout manager
injects them (slime/ray/engines/faults.py) while that rollout generates. The run-kill faults
(RUN_KILL_KINDS: a crash at a known point, for the resume tests) SIGKILL every process of the run
(driver, Ray, ranks, rollout manager, engines) when that phase of that rollout starts on that rank;
for kill_during_rollout '<rank>' is 0 (the rollout manager). They need the run started as its own
session (`setsid python train.py ...`): Ray puts each worker in a process group of its own, so the
session is what holds the whole run.
The rank faults (RANK_FAULT_KINDS) end one trainer rank only, once per run: what a run restarted by
--max-restarts (slime/ray/driver/healing.py) recovers from.
The faults are injected where the real bug would be (warm-up, plan, metrics, forward/backward, logging,
the weight push), never inside the fences that are supposed to catch them.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

ENV_VAR = "SLIME_FAULT_INJECT"

FAULT_KINDS = frozenset(
    {
        "stall_comm_init",  # rank never finishes communicator warm-up
        "diverge_plan",  # rank alters its micro-batch plan fields
        "extra_metric_key",  # rank reports one metric key the others lack
        "skip_collective",  # rank skips one collective of forward/backward
        "stall_logging",  # rank blocks in logging
        # Silent weight-push failures: the version still moves, only the engines' log-probs can tell.
        "skip_weight_push",  # the sending rank's buckets go out without their tensors
        "corrupt_weight_push",  # the sending rank's tensors go out with noise added
        "kill_engine",  # the engine process exits mid-generation
        "stall_engine",  # the engine process stops answering (health included) mid-generation
        # A crash of the whole run (SIGKILL to its process group) at one point of one rollout:
        "kill_during_rollout",  # the rollout starts (engines serving, its deadline running)
        "kill_during_train",  # actor_train's first phase has finished on the rank
        "kill_during_weight_sync",  # the rank starts pushing weights
        "kill_during_save",  # the rank's shards are written, the checkpoint is not yet published
        # One rank fails, once per run (what --max-restarts recovers from):
        "kill_rank_during_train",  # the rank's process exits in actor_train's log-prob phase
        "stall_rank_during_train",  # the rank blocks in actor_train's log-prob phase (its watchdog ends it)
    }
)
ENGINE_FAULT_KINDS = ("kill_engine", "stall_engine")
RANK_FAULT_KINDS = ("kill_rank_during_train", "stall_rank_during_train")
RUN_KILL_KINDS = ("kill_during_rollout", "kill_during_train", "kill_during_weight_sync", "kill_during_save")

CORRUPTION_STD = 0.05  # noise added by corrupt_weight_push (the tiny models' weights are ~0.02-1)

_SPEC_RE = re.compile(r"^(?P<kind>[a-z_]+)@(?P<rank>\d+)(?:#(?P<rollout>\d+))?$")
EXTRA_METRIC_KEY = "fault_injected/extra_metric"


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    rank: int
    rollout_id: int | None = None  # None: every rollout

    def matches(self, kind: str, rank: int, rollout_id: int | None) -> bool:
        if self.kind != kind or self.rank != rank:
            return False
        return self.rollout_id is None or self.rollout_id == rollout_id


def parse_fault_specs(text: str | None) -> tuple[FaultSpec, ...]:
    """Parse the env value; raise ValueError naming the bad part (checked at start-up)."""
    if not text or not text.strip():
        return ()
    specs = []
    for part in text.split(","):
        match = _SPEC_RE.match(part.strip())
        if match is None:
            raise ValueError(
                f"{ENV_VAR}: cannot parse {part!r}; expected <kind>@<rank>[#<rollout_id>], kinds: {sorted(FAULT_KINDS)}"
            )
        if match["kind"] not in FAULT_KINDS:
            raise ValueError(f"{ENV_VAR}: unknown fault kind {match['kind']!r}; known: {sorted(FAULT_KINDS)}")
        rollout = int(match["rollout"]) if match["rollout"] is not None else None
        specs.append(FaultSpec(match["kind"], int(match["rank"]), rollout))
    return tuple(specs)


_cached: tuple[FaultSpec, ...] | None = None


def active_faults() -> tuple[FaultSpec, ...]:
    """Faults configured for this process (env read and validated once)."""
    global _cached
    if _cached is None:
        _cached = parse_fault_specs(os.environ.get(ENV_VAR))
    return _cached


def reset_fault_cache() -> None:
    """Re-read the env on next use (tests that change it within one process)."""
    global _cached
    _cached = None


def fault_active(kind: str, rank: int, rollout_id: int | None = None) -> bool:
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r}")
    return any(spec.matches(kind, rank, rollout_id) for spec in active_faults())


def stall_forever(poll_s: float = 0.05) -> None:
    """Block like a hung call, but in short Python-level sleeps so a watchdog HangError can land."""
    while True:
        time.sleep(poll_s)


def maybe_kill_run(kind: str, rank: int, rollout_id: int | None) -> None:
    """A run-kill fault: SIGKILL every process of this session, the driver (the session leader) first and
    this one last. The driver first: Ray takes processes down with the ones they depend on (a raylet with
    its agents, a worker with its raylet), so this one may die before it is done, and a driver still alive
    would see an actor die and exit 1 instead of being killed."""
    if kind not in RUN_KILL_KINDS:
        raise ValueError(f"{kind!r} is not a run-kill fault; known: {RUN_KILL_KINDS}")
    if not fault_active(kind, rank, rollout_id):
        return
    session = os.getsid(0)
    leader = _cmdline(session)
    if "train.py" not in leader:  # never a login shell's session
        raise RuntimeError(f"{ENV_VAR}={kind}: the session leader is {leader!r}, not the run's train.py; start "
                           "the run as its own session (setsid)")
    if session != os.getpid():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(session, signal.SIGKILL)
    for _ in range(2):  # processes started meanwhile
        for pid in _session_pids(session) - {os.getpid()}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _session_pids(session: int) -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if entry.isdigit() and os.getsid(int(entry)) == session:
                pids.add(int(entry))
    return pids


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def maybe_fail_rank(kind: str, rank: int, rollout_id: int | None, marker_dir: str) -> None:
    """A rank fault (RANK_FAULT_KINDS): this rank's process exits, or blocks until its watchdog ends it. Once per
    run: a marker file in `marker_dir` (the run's ledger dir) keeps a run restarted by --max-restarts from
    failing again at the same point."""
    if kind not in RANK_FAULT_KINDS:
        raise ValueError(f"{kind!r} is not a rank fault; known: {RANK_FAULT_KINDS}")
    if not fault_active(kind, rank, rollout_id):
        return
    try:
        os.close(os.open(os.path.join(marker_dir, f"fault_fired_{kind}_{rank}_{rollout_id}"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:  # fired in an earlier attempt of this run
        return
    if kind == "kill_rank_during_train":
        os.kill(os.getpid(), signal.SIGKILL)
    stall_forever()


def maybe_stall(kind: str, rank: int, rollout_id: int | None = None) -> None:
    if fault_active(kind, rank, rollout_id):
        stall_forever()


def apply_plan_fault(fields: Mapping[str, object], rank: int, rollout_id: int | None) -> dict[str, object]:
    """diverge_plan: this rank claims one extra micro-batch and a different plan hash."""
    fields = dict(fields)
    if fault_active("diverge_plan", rank, rollout_id):
        fields["num_micro_batches"] = int(fields.get("num_micro_batches", 0)) + 1
        fields["plan_hash"] = f"diverged-{fields.get('plan_hash', '')}"
    return fields


def apply_metric_key_fault(keys: Iterable[str], rank: int, rollout_id: int | None) -> tuple[str, ...]:
    """extra_metric_key: this rank adds a metric key the others do not have."""
    keys = set(keys)
    if fault_active("extra_metric_key", rank, rollout_id):
        keys.add(EXTRA_METRIC_KEY)
    return tuple(sorted(keys))


def apply_weight_push_fault(named_tensors: list, rank: int, rollout_id: int | None) -> list:
    """skip_weight_push / corrupt_weight_push on the (name, tensor) pairs of one bucket about to be sent."""
    if fault_active("skip_weight_push", rank, rollout_id):
        return []
    if fault_active("corrupt_weight_push", rank, rollout_id):
        import torch

        generator = torch.Generator().manual_seed(rollout_id or 0)
        return [(name, tensor + CORRUPTION_STD * torch.randn(tensor.shape, generator=generator).to(tensor))
                for name, tensor in named_tensors]
    return named_tensors


def should_skip_collective(rank: int, rollout_id: int | None) -> bool:
    """skip_collective: the caller skips exactly one forward/backward collective when this is True."""
    return fault_active("skip_collective", rank, rollout_id)


# The collectives skip_collective may drop, with the position of their `group` argument when passed positionally.
_SKIPPABLE_OPS = {"all_gather_into_tensor": 2, "all_reduce": 2, "all_gather": 2, "reduce_scatter_tensor": 3,
                  "broadcast": 2}


class _SkippedWork:
    """Stands in for the Work handle of a collective that was never issued."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def skipping_one_collective() -> Iterator[None]:
    """skip_collective: the first collective issued through torch.distributed in the block, on a group of more
    than one rank, is dropped (an op on a one-rank group has no peer to miss it, e.g. the TP group at TP1).

    The peers then wait in that collective while this rank runs ahead into the next one, which is
    the shape of a real rank-local skip: a mismatch that only a deadline can turn into an error.
    """
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in _SKIPPABLE_OPS}
    skipped = [False]

    def make(name):
        def maybe_skip(*args, **kwargs):
            position = _SKIPPABLE_OPS[name]
            group = kwargs.get("group", args[position] if len(args) > position else None)
            if skipped[0] or dist.get_world_size(group) == 1:
                return originals[name](*args, **kwargs)
            skipped[0] = True
            return _SkippedWork() if kwargs.get("async_op") else None

        return maybe_skip

    for name in _SKIPPABLE_OPS:
        setattr(dist, name, make(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
