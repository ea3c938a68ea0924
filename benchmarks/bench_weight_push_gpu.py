"""The colocated weight push on one GPU: shared-memory file against CUDA IPC, side by side.

    python benchmarks/bench_weight_push_gpu.py --checkpoint DIR [--repeats 5] [--json out.json]

One embedded engine on cuda:0 (bf16) and, in this process, the checkpoint's tensors on cuda:0 (bf16),
packed into the sync's 512 MiB buckets. Each push is what the fenced sync's push phase does: one
weight-update session, every bucket through `TensorTransport.send`, the version with the last one.
  shm  device -> host -> /dev/shm file -> host -> device (`slime_shm`; the path before CUDA IPC)
  ipc  flattened bucket as a CUDA-IPC handle (`flattened_bucket`): device -> device
After each IPC push a sample of every tensor is read back from the engine and compared.
Prints per method the median push seconds and bytes/s, next to this GPU's own copy bandwidth
(device-to-device, and pinned host <-> device), measured in the same process with CUDA events.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slime.backends.weight_sync.plan import DEFAULT_BUCKET_BYTES, pack_buckets
from slime.backends.weight_sync.transport import EngineSet, TensorTransport
from slime.backends.sglang_utils.http_client import ClientTimeouts
from slime.backends.sglang_utils.launcher import launch_engine
from slime.config import defaults_namespace
from slime.utils.security import ApiKey, use_key

METHODS = ("shm", "ipc")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="HF checkpoint dir (safetensors)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a logic check of this script (both methods shm)")
    return parser.parse_args(argv)


def load_weights(checkpoint: str, device: str) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    named = []
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        named += [(k, v.to(device, torch.bfloat16)) for k, v in load_file(str(path)).items()]
    return named


def copy_bandwidth(nbytes: int) -> dict[str, float]:
    """GB/s of one copy of `nbytes`: device to device, pinned host to device, device to pinned host."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    other = torch.empty_like(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pairs = {"d2d": (other, device), "h2d_pinned": (device, host), "d2h_pinned": (host, device)}
    result = {}
    for name, (dst, src) in pairs.items():
        dst.copy_(src, non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        result[name] = nbytes * 5 / (start.elapsed_time(end) / 1e3) / 1e9
    return result


def push(transport: TensorTransport, engines: EngineSet, buckets, version: str) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    engines.begin_session()
    try:
        for index, tensors in enumerate(buckets):
            last = index == len(buckets) - 1
            transport.send(index, tensors, version=version if last else None, flush_cache=last)
    finally:
        engines.end_session()
    seconds = time.perf_counter() - start
    got = engines.each(lambda c: c.weight_version())
    assert got == [version], f"engine reports {got}, pushed {version}"
    return seconds


def check_equal(engines: EngineSet, named) -> int:
    """Compare the first 64 values of every tensor as the engine serves them; returns how many were checked."""
    client = engines.clients[0]
    for name, tensor in named:
        served = torch.tensor(client.get_weights_by_name(name, truncate_size=64), dtype=torch.float32)
        sent = tensor.flatten()[:64].float().cpu()
        if not torch.equal(served, sent):
            raise AssertionError(f"{name}: the engine serves other values than were pushed")
    return len(named)


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    named = load_weights(opts.checkpoint, opts.device)
    on_gpu = opts.device == "cuda"
    by_name = dict(named)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    plan = pack_buckets([(n, t.numel() * t.element_size()) for n, t in named], opts.bucket_bytes)
    buckets = [[(n, by_name[n]) for n in bucket.hf_names] for bucket in plan]
    use_key(ApiKey.generate())
    args = defaults_namespace(seed=1, bf16=True, fence_timeout=300.0, update_weight_buffer_size=opts.bucket_bytes,
                              train_backend_device="auto" if on_gpu else "cpu", sglang_server_args={})
    workdir = Path(tempfile.mkdtemp(prefix="bench-push-gpu-"))
    handle = launch_engine("embedded", args, 0, 0, opts.checkpoint, gpu_ids=[0] if on_gpu else None,
                           startup_timeout_s=300,
                           log_dir=str(workdir))
    engines = EngineSet((handle.url,), ClientTimeouts(weight_update=300.0))
    transports = {"shm": TensorTransport(engines, "embedded", 1, allow_ipc=False),
                  "ipc": TensorTransport(engines, "embedded", 1)}
    seconds: dict[str, list[float]] = {m: [] for m in METHODS}
    checked = 0
    try:
        for repeat in range(opts.repeats + 1):  # round 0 warms up
            for method in METHODS:
                elapsed = push(transports[method], engines, buckets, f"{method}-{repeat}")
                if repeat:
                    seconds[method].append(elapsed)
            checked = check_equal(engines, named)  # after the round's IPC push
        memory = engines.clients[0].server_info().get("memory")
    finally:
        for transport in transports.values():
            transport.close()
        engines.close()
        handle.stop()
    bandwidth = copy_bandwidth(min(nbytes, opts.bucket_bytes)) if on_gpu else {"d2d": float("nan")}
    report(nbytes, len(plan), seconds, bandwidth, checked, memory, opts.json)


def report(nbytes, n_buckets, seconds, bandwidth, checked, memory, path) -> None:
    medians = {m: statistics.median(v) for m, v in seconds.items()}
    print(f"WEIGHT_PUSH {nbytes / 1e9:.3f} GB in {n_buckets} buckets to one embedded engine on the same GPU, "
          f"median of {len(seconds['ipc'])} pushes; {checked} tensors read back equal after IPC pushes")
    print(f"WEIGHT_PUSH copy bandwidth GB/s: " + ", ".join(f"{k} {v:.1f}" for k, v in bandwidth.items()))
    for method in METHODS:
        rate = nbytes / medians[method] / 1e9
        print(f"WEIGHT_PUSH {method:<4} {medians[method]:.3f} s  {rate:7.2f} GB/s  "
              f"({rate / bandwidth['d2d']:.1%} of d2d)  all: {', '.join(f'{s:.3f}' for s in seconds[method])}")
    print(f"WEIGHT_PUSH ipc is {medians['shm'] / medians['ipc']:.1f}x faster; engine memory {memory}")
    if path:
        Path(path).write_text(json.dumps({"bytes": nbytes, "buckets": n_buckets, "seconds": seconds,
                                          "copy_gbps": bandwidth, "checked": checked, "engine_memory": memory},
                                         indent=1))


if __name__ == "__main__":
    main()
