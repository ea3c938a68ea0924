"""The weight-sync proof: after every push, every engine serves exactly the trainer's weights, tensor by tensor.

The sibling of the order proof (slime/distributed/order_proof.py): that one proves every rank ran the same
collectives; this one proves the engines hold what the trainer trained. It runs inside the fenced weight sync
(sync.py), on by default (`--no-weight-sync-proof` turns it off), in three parts:

  sender     before the first push to its engines, asks each for its checksums (SGLang's `/weights_checker`,
             sglang_utils/weight_checker.py) to learn the dtype it holds each tensor in; every tensor then goes
             out cast to that dtype (a bf16 routing bias is pushed as bf16, so a delta against it can match) and
             is digested as handed to the transport (sglang_utils/tensor_digest.py), on its device and stream, on
             the proof's thread while the bucket is sent; the bucket is let go (its memory free for the next
             export) only once its digests are taken.
  exporter   with a subset push (LoRA: only what training changes goes out after the first push), digests the
             local shard of every exported tensor the subset leaves out and compares it with its digest at the
             last full push: a tensor that changed on the trainer but is no longer pushed is named.
  coordinator  asks every engine for its checksums at once as the proof begins (the engines digest while it
             does its own part and the gather), gathers the senders' digests (one gather_object over the fence
             group, to world rank 0), keeps per engine what was pushed to it and at which version, awaits the
             engines' answers against one deadline (every late or failing engine named) and compares: a digest
             that differs, a pushed tensor the engine lacks, a tensor the engine serves that no push ever wrote.
             A tensor the trainer does not build (a composite checkpoint's vision tower in a run that trains its
             text model alone) is never pushed: the engine loaded it from --hf-checkpoint, so it is compared with
             the checkpoint's, and a finding says why the trainer does not own it.

Every finding names the engine, the tensor and the version, and is raised as a WeightProofError through the
sync's fence, on every rank alike. The engines' own digests cover parameters and buffers alike: the embedded
engine serves every tensor under the name it was loaded or pushed under, and anything no such name covers
under transformers' own name (backends/embedded_engine/engine.py). SGLang answers with its own names (fused
qkv / gate_up, TP shards) and its own hash, which the trainer does not reproduce: there the proof checks that
every engine serves the same checksums as the first (an engine a push missed or corrupted differs from its
peers), not that they equal the trainer's (docs/fenced-step.md).
"""
from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from slime.backends.weight_sync.transport import EngineSet, NamedTensors, engine_call
from slime.backends.sglang_utils.tensor_digest import GROUP_BYTES, digest_dtype, tensor_digests
from slime.backends.sglang_utils.weight_checker import EngineChecksums, parse_checksum_response
from slime.distributed.errors import DistributedStepError
from slime.models.hf_weights import exported_tensors, unwrap_model

logger = logging.getLogger(__name__)

MAX_LISTED = 8  # findings spelled out in the error; the rest are counted
EVERY_ENGINE = "every engine"


class WeightProofError(RuntimeError):
    """An engine does not serve the trainer's weights after a push (tensor, engine and version named)."""


@dataclass(frozen=True)
class ProofFinding:
    engine: str
    tensor: str
    version: str
    problem: str

    def format(self) -> str:
        engine = self.engine if self.engine == EVERY_ENGINE else f"engine {self.engine}"
        return f"{engine}, tensor {self.tensor!r}, version {self.version}: {self.problem}"


@dataclass
class _Pushed:
    """What one sender pushed in one sync: the engines it fed; per tensor, its digest in each dtype they hold it."""

    engines: tuple[str, ...] = ()
    digests: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Expected:
    digests: dict[str, str]  # dtype -> digest
    version: str


@dataclass(frozen=True)
class CarriedTensors:
    """Tensors the engines load from the HF checkpoint and the trainer never pushes, because it does not build them;
    `read` yields them (name, tensor) as the checkpoint holds them."""

    read: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    reason: str


class WeightProof:
    """One rank's part of the proof; `prepare` on senders, `run` on every rank of every sync."""

    def __init__(self, engine_kind: str, *, enabled: bool, subset: Callable[[str], bool] | None = None,
                 carried: CarriedTensors | None = None) -> None:
        """subset: the megatron names a push after the first sends (None: every push is full); carried: what the
        engines hold from --hf-checkpoint that the trainer does not build."""
        self.engine_kind = engine_kind
        self.enabled = enabled
        self.subset = subset
        self.carried = carried
        self._carried_digests: dict[str, dict[str, str]] = {}  # coordinator: dtype -> tensor -> checkpoint digest
        self._served_dtypes: dict[str, dict[str, str]] = {}  # sender: engine -> tensor -> the dtype it holds
        self._pushed = _Pushed()  # sender: this sync's digests
        self._expected: dict[str, dict[str, _Expected]] = {}  # coordinator: engine -> tensor -> last pushed
        self._left_out: dict[str, tuple[str, str]] = {}  # exporter: megatron name -> (digest, version) at full push
        self._pool: ThreadPoolExecutor | None = None  # sender: the thread that digests a bucket while it is sent
        self._seconds = 0.0
        self._compared = 0

    def start_sync(self) -> None:
        """A sync begins: nothing pushed yet, its figures from zero (a failed sync leaves none behind)."""
        self._pushed = _Pushed()
        self._seconds, self._compared = 0.0, 0

    def reset(self) -> None:
        """The engines changed (restarted, re-targeted): what they hold and how is learnt again."""
        self._served_dtypes.clear()
        self._pushed = _Pushed()
        self._expected.clear()

    # -- sender ------------------------------------------------------------------------------
    def prepare(self, engines: EngineSet, tensors: NamedTensors) -> NamedTensors:
        """The bucket as it goes out, digested before this returns (`sending` digests it while it is sent)."""
        with self.sending(engines, tensors) as cast:
            return cast

    @contextlib.contextmanager
    def sending(self, engines: EngineSet, tensors: NamedTensors) -> Iterator[NamedTensors]:
        """The bucket as it goes out: each tensor in the dtype every engine holds it. When proving, its digests are
        taken on this proof's thread while the caller sends it, and awaited when the block ends: the bucket is not
        let go (its memory reused by the next export) before they are. A digest's error is raised at the end of the
        block, unless the block raised its own."""
        if self.engine_kind != "embedded":  # SGLang does not say its dtypes; it casts on load
            yield tensors
            return
        held = self._dtypes(engines)
        cast = []
        for name, tensor in tensors:
            dtypes = {held[url].get(name) for url in engines.urls} - {None}
            cast.append((name, tensor.to(getattr(torch, dtypes.pop())) if len(dtypes) == 1 else tensor))
        if not self.enabled:
            yield cast
            return
        self._pushed.engines = engines.urls
        deadline_s = _deadline_s(engines)
        digesting = self._digester().submit(_digests_as_held, cast, engines.urls, held, _current_stream(cast))
        try:
            yield cast
        except BaseException:
            futures_wait([digesting], timeout=deadline_s)  # its tensors stay untouched until it ends
            raise
        start = time.perf_counter()
        try:
            self._pushed.digests.update(digesting.result(timeout=deadline_s))
        except FutureTimeout:
            raise WeightProofError(f"weight-sync proof: the digests of a bucket of {len(cast)} tensor(s) were not "
                                   f"taken within {deadline_s:g}s") from None
        finally:
            self._seconds += time.perf_counter() - start  # what the push waited for them

    def _digester(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-proof-digest")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _dtypes(self, engines: EngineSet) -> dict[str, dict[str, str]]:
        missing = [client for client in engines.clients if client.base_url not in self._served_dtypes]
        if missing:
            answers = engines.each(lambda client: parse_checksum_response(client.check_weights()), missing)
            for client, answer in zip(missing, answers):
                self._served_dtypes[client.base_url] = {n: digest_dtype(d) for n, d in answer.single.items()}
        return self._served_dtypes

    # -- every rank ----------------------------------------------------------------------------
    def run(self, *, model_chunks: Sequence[torch.nn.Module], full_push: bool, exporter: bool, coordinator: bool,
            read_param: Callable[[torch.Tensor], torch.Tensor] | None, engines: EngineSet | None, group: Any,
            version: str, ledger: Any = None) -> Exception | None:
        """This rank's part after the push; its error (not raised: the caller's fence carries it to every rank).
        Every rank calls it: it holds the gather of the senders' digests."""
        start = time.perf_counter()
        asked: list[_AskedEngines] = []  # the engines digest while this rank does its part and the gather
        error = _attempt(lambda: asked.append(_AskedEngines.ask(engines))) if coordinator else None
        if exporter and self.subset is not None:
            left_out = _attempt(lambda: self._check_left_out(model_chunks, full_push, read_param, version, ledger))
            error = error or left_out
        pushed, self._pushed = self._pushed, _Pushed()
        gathered = _gather_to_first(pushed if pushed.digests else None, group)
        if coordinator and asked:
            error = error or _attempt(lambda: self._check_engines(gathered, asked[0], version, ledger))
        self._seconds += time.perf_counter() - start
        return error

    def take_metrics(self) -> dict[str, float]:
        """This sync's figures: this rank's time in the proof, the coordinator's count of (engine, tensor) pairs
        compared."""
        if not self.enabled:
            return {}
        return {"weight_sync/proof_seconds": self._seconds, "weight_sync/proof_tensors": float(self._compared)}

    # -- exporter: what a subset push leaves out ---------------------------------------------------
    def _check_left_out(self, model_chunks, full_push: bool, read_param, version: str, ledger) -> None:
        names = [(name, tensor) for chunk in model_chunks
                 for name, tensor in exported_tensors(unwrap_model(chunk), mtp=False)
                 if full_push or not self.subset(name)]
        digests = dict(zip((n for n, _ in names), _digests_read(names, read_param or (lambda t: t.detach()),
                                                                ledger)))
        if full_push:
            self._left_out = {name: (digest, version) for name, digest in digests.items()}
            return
        findings = [ProofFinding(EVERY_ENGINE, name, self._left_out[name][1],
                                 "pushed whole at this version, changed since on the trainer, left out of the pushes "
                                 "after it: the engines serve the old value")
                    for name, digest in digests.items() if self._left_out.get(name, (digest,))[0] != digest]
        if findings:
            raise WeightProofError(_message(findings, version, "changed on the trainer but were left out of the push"))

    # -- coordinator: what the engines serve ---------------------------------------------------------
    def _check_engines(self, gathered: Iterable[_Pushed | None], asked: "_AskedEngines", version: str,
                       ledger) -> None:
        for pushed in filter(None, gathered):
            for url in pushed.engines:
                expected = self._expected.setdefault(url, {})
                for name, digests in pushed.digests.items():
                    expected[name] = _Expected(digests, version)
        answers = asked.answers(version, ledger)
        if self.engine_kind == "embedded":
            findings = [finding for url, answer in zip(asked.urls, answers)
                        for finding in self._against_trainer(url, answer, version)]
        else:
            findings = _against_first_engine(asked.urls, answers, version)
        if findings:
            raise WeightProofError(_message(findings, version, "differ between the trainer and the engines"))

    def _against_trainer(self, url: str, answer: EngineChecksums, version: str) -> list[ProofFinding]:
        served = answer.single
        expected = self._expected.get(url, {})
        self._compared += len(expected)
        findings = []
        for name, pushed in expected.items():
            digest = served.get(name)
            if digest is None:
                findings.append(ProofFinding(url, name, pushed.version, "pushed, but the engine does not serve it"))
            elif digest_dtype(digest) not in pushed.digests:
                findings.append(ProofFinding(url, name, pushed.version, f"served in {digest_dtype(digest)}, pushed "
                                             f"in {sorted(pushed.digests)}"))
            elif digest != pushed.digests[digest_dtype(digest)]:
                findings.append(ProofFinding(url, name, pushed.version, f"the engine serves {digest}, the trainer "
                                             f"pushed {pushed.digests[digest_dtype(digest)]}"))
        unwritten = sorted(set(served) - set(expected))
        findings += self._against_checkpoint(url, served, unwritten)
        carried = set().union(*self._carried_digests.values()) if self._carried_digests else set()
        findings += [ProofFinding(url, name, version, "served by the engine, but no push ever wrote it")
                     for name in unwritten if name not in carried]
        return findings

    def _against_checkpoint(self, url: str, served: dict[str, str], unwritten: list[str]) -> list[ProofFinding]:
        """The carried tensors the engine serves equal the checkpoint's, in the dtype it serves each in."""
        if self.carried is None or not unwritten:
            return []
        for dtype in sorted({digest_dtype(served[name]) for name in unwritten} - set(self._carried_digests)):
            self._carried_digests[dtype] = _grouped_digests(self.carried.read(), getattr(torch, dtype))
        findings = []
        for name in unwritten:
            want = self._carried_digests[digest_dtype(served[name])].get(name)
            if want is not None:
                self._compared += 1
            if want is not None and want != served[name]:
                findings.append(ProofFinding(url, name, "loaded", f"the engine serves {served[name]}, the "
                                             f"checkpoint holds {want}; {self.carried.reason}"))
        return findings


def _deadline_s(engines: EngineSet) -> float:
    """The proof's waits (a bucket's digests, every engine's answer) are bounded like a weight update."""
    return max(client.timeouts.weight_update for client in engines.clients)


def _current_stream(tensors: NamedTensors) -> Any:
    """The sender's CUDA stream where the bucket is on a GPU (its digests queue after the kernels that made it)."""
    device = next((t.device for _, t in tensors if t.device.type == "cuda"), None)
    return None if device is None else torch.cuda.current_stream(device)


def _digests_as_held(tensors: NamedTensors, urls: tuple[str, ...], held: dict[str, dict[str, str]],
                     stream: Any) -> dict[str, dict[str, str]]:
    """Per tensor: its digest as sent, and one in every other dtype an engine holds it in (engines that disagree
    on a tensor's dtype each get it in their own). Runs on the proof's thread, on the sender's device and stream."""
    with contextlib.ExitStack() as on_device:
        if stream is not None:
            on_device.enter_context(torch.cuda.device(stream.device))
            on_device.enter_context(torch.cuda.stream(stream))
        digests: dict[str, dict[str, str]] = {}
        others = []
        for (name, tensor), digest in zip(tensors, tensor_digests([t for _, t in tensors])):
            digests[name] = {digest_dtype(digest): digest}
            dtypes = {held[url].get(name) for url in urls} - {None, digest_dtype(digest)}
            others += [(name, tensor.to(getattr(torch, dtype))) for dtype in sorted(dtypes)]
        for (name, _), digest in zip(others, tensor_digests([t for _, t in others])):
            digests[name][digest_dtype(digest)] = digest
    return digests


@dataclass(frozen=True)
class _AskedEngines:
    """The coordinator's `/weights_checker` call, made to every engine at once as the proof begins (the engines
    digest what they serve while this rank checks what a subset push left out and gathers the senders' digests),
    answered against one deadline for all: every engine late or failing is named, not only the first."""

    urls: tuple[str, ...]
    calls: tuple[Future, ...]
    deadline: float  # time.monotonic()
    timeout_s: float

    @classmethod
    def ask(cls, engines: EngineSet) -> "_AskedEngines":
        timeout_s = _deadline_s(engines)
        calls = engines.submit_each(lambda client: parse_checksum_response(client.check_weights()))
        return cls(engines.urls, tuple(calls), time.monotonic() + timeout_s, timeout_s)

    def answers(self, version: str, ledger: Any) -> list[EngineChecksums]:
        with engine_call(ledger, "weight_sync/proof", len(self.urls), "engines"):
            futures_wait(self.calls, timeout=max(0.0, self.deadline - time.monotonic()))
            problems = [(url, call) for url, call in zip(self.urls, self.calls)
                        if not call.done() or call.exception() is not None]
            if problems:
                said = "; ".join(f"engine {url}: " + (f"no answer within {self.timeout_s:g}s" if not call.done() else
                                                      f"{type(call.exception()).__name__}: {call.exception()}")
                                 for url, call in problems)
                cause = next((call.exception() for _, call in problems if call.done()), None)
                raise WeightProofError(f"weight-sync proof after the push of version {version}: {len(problems)} "
                                       f"engine(s) did not report what they serve: {said}") from cause
            return [call.result() for call in self.calls]


def _digests_read(named: list[tuple[str, torch.Tensor]], read: Callable[[torch.Tensor], torch.Tensor],
                  ledger) -> list[str]:
    """Digests of the tensors as `read` gives them (a sleeping trainer: copies of its host backups), a group's
    worth at a time so the copies never hold more than GROUP_BYTES at once; each group is progress."""
    digests: list[str] = []
    batch, size = [], 0
    for index, (_, tensor) in enumerate(named):
        value = read(tensor)
        batch.append(value)
        size += value.numel() * value.element_size()
        if size >= GROUP_BYTES or index == len(named) - 1:
            digests += tensor_digests(batch)
            batch, size = [], 0
            if ledger is not None:
                ledger.note_progress()
    return digests


def _grouped_digests(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, str]:
    """Digests of the tensors cast to `dtype`, read and digested a group's worth at a time."""
    digests: dict[str, str] = {}
    names, batch, size = [], [], 0
    for name, tensor in named:
        names.append(name)
        batch.append(tensor.to(dtype))
        size += batch[-1].numel() * batch[-1].element_size()
        if size >= GROUP_BYTES:
            digests.update(zip(names, tensor_digests(batch)))
            names, batch, size = [], [], 0
    digests.update(zip(names, tensor_digests(batch)))
    return digests


def _against_first_engine(urls: Sequence[str], answers: Sequence[EngineChecksums], version: str
                          ) -> list[ProofFinding]:
    """SGLang: every engine's checksums (per GPU: TP, DP, PP rank) equal the first engine's."""
    reference = answers[0].per_gpu
    findings = []
    for url, answer in zip(urls[1:], answers[1:]):
        for gpu in sorted(set(reference) | set(answer.per_gpu)):
            mine, theirs = answer.per_gpu.get(gpu, {}), reference.get(gpu, {})
            for name in sorted(set(mine) | set(theirs)):
                if mine.get(name) != theirs.get(name):
                    findings.append(ProofFinding(url, f"{name} (tp, dp, pp ranks {gpu})", version,
                                                 f"checksum {mine.get(name)} differs from {urls[0]}'s "
                                                 f"{theirs.get(name)}"))
    return findings


def _message(findings: list[ProofFinding], version: str, what: str) -> str:
    listed = "; ".join(f.format() for f in findings[:MAX_LISTED])
    more = f"; and {len(findings) - MAX_LISTED} more" if len(findings) > MAX_LISTED else ""
    return f"weight-sync proof after the push of version {version}: {len(findings)} tensor(s) {what}: {listed}{more}"


def _gather_to_first(obj: Any, group: Any) -> list[Any]:
    """Every rank's object on world rank 0 (one gather_object over `group`, the world's fence group); a world
    of one gathers nothing."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    gathered = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0, group=group)
    return gathered or []


def _attempt(action: Callable[[], Any]) -> Exception | None:
    """A rank-local part's error, to be carried by the fence; fence and watchdog errors concern every rank."""
    try:
        action()
    except DistributedStepError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported at the fence, re-raised there
        return exc
    return None
