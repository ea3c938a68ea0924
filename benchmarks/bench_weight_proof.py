"""Where the weight-sync proof's time goes, part by part, on one push to embedded engines.

    python benchmarks/bench_weight_proof.py [--checkpoint DIR] [--engines 1] [--device cpu|cuda] [--repeats 5]

One or more embedded engines (own processes, as in the loop) on --device serve --checkpoint (default: a tiny
Qwen3 written here, 8 layers, hidden 512); this process holds the same tensors on --device, moved off the
checkpoint, and pushes them as the fenced sync's push phase does (one session, every bucket through
TensorTransport.send, the version with the last), then runs the proof's coordinator part. Each push is timed
twice side by side, the proof off and on, so the proof's wall-clock cost is a difference of two pushes measured
in the same process. Printed per push (medians over --repeats, after one warm-up push of each kind):
  sender      what the push waited for the digests of what it sent (proof_seconds minus the coordinator's part)
  engines     the coordinator's /weights_checker call (the engines digest what they serve, answer, are parsed)
  rtt         a control round trip to the same engines (GET /weight_version): the HTTP floor
  compare     the coordinator's comparison (the proof's run minus its engine call)
  digest      one side's digest of every tensor, in this process, on --device (tensor_digest.tensor_digests)
  calls       HTTP calls per push per engine, by route, proof off and on
  wall        the push + proof wall-clock seconds off and on, and their difference
Prints lines starting `WEIGHT_PROOF`.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slime.backends.sglang_utils.http_client import ClientTimeouts, SGLangHTTPClient
from slime.backends.sglang_utils.launcher import launch_engine
from slime.backends.weight_sync.plan import DEFAULT_BUCKET_BYTES, pack_buckets
from slime.backends.weight_sync.proof import WeightProof
from slime.backends.weight_sync.transport import EngineSet, TensorTransport
from slime.config import defaults_namespace
from slime.utils.security import ApiKey, use_key


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="HF checkpoint dir (safetensors); default: a tiny Qwen3")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def tiny_checkpoint(workdir: Path) -> str:
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

    spec = TinyQwen3Spec(alphabet="0123456789", layers=8, hidden=512, heads=8, kv_heads=4, head_dim=64,
                         ffn_hidden=1536)
    return str(write_tiny_checkpoint(workdir / "model", spec))


class CallCounter:
    """Counts SGLangHTTPClient calls by (route); installed on the class, so every engine set in this process."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self._original = SGLangHTTPClient._call
        counter = self

        def counted(client, method, path, timeout, payload=None):
            counter.counts[path] += 1
            return counter._original(client, method, path, timeout, payload)

        SGLangHTTPClient._call = counted

    def take(self) -> dict[str, int]:
        counts, self.counts = dict(self.counts), collections.Counter()
        return counts


def timed_check_weights(seconds: list[float]):
    """Wraps SGLangHTTPClient.check_weights to add each engine call's seconds (the longest of a concurrent set
    is what the proof waits for; with one engine, the call)."""
    original = SGLangHTTPClient.check_weights

    def check_weights(client):
        start = time.perf_counter()
        try:
            return original(client)
        finally:
            seconds.append(time.perf_counter() - start)

    SGLangHTTPClient.check_weights = check_weights


def push(proof: WeightProof, engines: EngineSet, transport: TensorTransport, buckets, version: str) -> dict:
    start = time.perf_counter()
    proof.start_sync()
    engines.begin_session()
    try:
        for index, bucket in enumerate(buckets):
            last = index == len(buckets) - 1
            with proof.sending(engines, bucket) as cast:  # as the sync sends: digested while it goes out
                transport.send(index, cast, version=version if last else None, flush_cache=last)
    finally:
        engines.end_session()
    pushed = time.perf_counter()
    error = None
    if proof.enabled:
        error = proof.run(model_chunks=[], full_push=True, exporter=False, coordinator=True, read_param=None,
                          engines=engines, group=None, version=version)
    if error is not None:
        raise error
    end = time.perf_counter()
    return {"wall": end - start, "push": pushed - start, "run": end - pushed, **proof.take_metrics()}


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    use_key(ApiKey.generate())
    workdir = Path(tempfile.mkdtemp(prefix="bench-weight-proof-"))
    checkpoint = opts.checkpoint or tiny_checkpoint(workdir)
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(0)
    # the trainer's export in the engines' dtype (a bf16 run's), moved off the checkpoint: no cast on the way out
    loaded = [item for path in sorted(Path(checkpoint).glob("*.safetensors")) for item in load_file(str(path)).items()]
    named = sorted((name, (t.float() + 0.01 * torch.randn(t.shape, generator=generator)).to(opts.device,
                                                                                            torch.bfloat16))
                   for name, t in loaded)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    plan = pack_buckets([(n, t.numel() * t.element_size()) for n, t in named], opts.bucket_bytes)
    by_name = dict(named)
    buckets = [[(n, by_name[n]) for n in bucket.hf_names] for bucket in plan]
    on_gpu = opts.device.startswith("cuda")
    args = defaults_namespace(seed=1, bf16=True, fence_timeout=300.0, update_weight_buffer_size=opts.bucket_bytes,
                              train_backend_device="auto" if on_gpu else "cpu", sglang_server_args={})
    handles = [launch_engine("embedded", args, i, 0, checkpoint, gpu_ids=[0] if on_gpu else None,
                             startup_timeout_s=300, log_dir=str(workdir)) for i in range(opts.engines)]
    engines = EngineSet(tuple(h.url for h in handles), ClientTimeouts(weight_update=300.0))
    transport = TensorTransport(engines, "embedded", 1)
    counter = CallCounter()
    engine_seconds: list[float] = []
    timed_check_weights(engine_seconds)
    proofs = {"off": WeightProof("embedded", enabled=False), "on": WeightProof("embedded", enabled=True)}
    rows: dict[str, list[dict]] = {"off": [], "on": []}
    calls: dict[str, dict[str, int]] = {}
    rtt: list[float] = []
    try:
        for repeat in range(opts.repeats + 1):  # round 0 warms up (and learns the engines' dtypes)
            for mode, proof in proofs.items():
                counter.take()
                engine_seconds.clear()
                row = push(proof, engines, transport, buckets, f"{mode}-{repeat}")
                row["engines"] = max(engine_seconds, default=0.0)
                row["calls"] = counter.take()
                if repeat:
                    rows[mode].append(row)
                    calls[mode] = row["calls"]
            start = time.perf_counter()
            engines.each(lambda client: client.weight_version())
            rtt.append(time.perf_counter() - start)
            counter.take()
    finally:
        transport.close()
        engines.close()
        for handle in handles:
            handle.stop()
    report(opts, nbytes, len(named), len(plan), rows, calls, rtt[1:], digest_seconds(named, opts.repeats))


def digest_seconds(named, repeats: int) -> float:
    """One side's digest of every tensor (what the engine does per push, what the sender does bucket by bucket)."""
    from slime.backends.sglang_utils.tensor_digest import tensor_digests

    tensor_digests([t for _, t in named])  # compiles on a GPU
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tensor_digests([t for _, t in named])  # the digests come back to the host: synchronised
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def report(opts, nbytes: int, tensors: int, n_buckets: int, rows, calls, rtt: list[float], digest_s: float
           ) -> None:
    def median(mode: str, key: str) -> float:
        return statistics.median(row.get(key, 0.0) for row in rows[mode])

    on_wall, off_wall = median("on", "wall"), median("off", "wall")
    proof_s = median("on", "weight_sync/proof_seconds")
    engines_s, run_s = median("on", "engines"), median("on", "run")
    sender_s = max(proof_s - run_s, 0.0)
    print(f"WEIGHT_PROOF {tensors} tensors, {nbytes / 1e9:.3f} GB in {n_buckets} buckets, {opts.engines} embedded "
          f"engine(s) on {opts.device}, median of {len(rows['on'])} pushes each way")
    print(f"WEIGHT_PROOF parts (s): sender {sender_s:.4f}  engines {engines_s:.4f}  rtt {statistics.median(rtt):.4f}  "
          f"compare {max(run_s - engines_s, 0.0):.4f}  proof_seconds {proof_s:.4f}  (one side's digest of every "
          f"tensor: {digest_s:.4f})")
    per_engine = {mode: {route: n / opts.engines for route, n in sorted(c.items())} for mode, c in calls.items()}
    print(f"WEIGHT_PROOF calls per push per engine: off {per_engine.get('off')}  on {per_engine.get('on')}")
    print(f"WEIGHT_PROOF wall (s): off {off_wall:.4f}  on {on_wall:.4f}  proof adds {on_wall - off_wall:.4f} "
          f"({(on_wall - off_wall) / off_wall:.1%} of the push)")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"rows": rows, "rtt": rtt, "calls": per_engine}, indent=1))


if __name__ == "__main__":
    main()
