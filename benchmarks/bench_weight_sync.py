"""Weight sync to embedded engines on one host: the old wire format against the new ones, side by side.

    python benchmarks/bench_weight_sync.py [--engines 8] [--repeats 3] [--demo-metrics outputs/demo/metrics.jsonl]

Pushes the demo's weights (the tiny Qwen3 of `make demo`: 78 MB, one bucket at the default 512 MiB
buffer) into N running embedded engines, the way the fenced sync does it (one weight-update session per
push, every engine concurrently), with each payload:
  old          base64 safetensors in JSON (`slime_safetensors`), encoded once per bucket
  shm          one shared-memory file per bucket and host, mapped by every engine (`slime_shm`): colocated
  distributed  SGLang's distributed path: engines join a gloo group, the sender broadcasts each tensor
and prints per method: sync seconds, GB/s per engine (bytes each engine received / sync seconds), and
where the old format's time goes (export, encode, decode, copy measured alone in this process; HTTP
and contention the rest). With --demo-metrics it also prints the demo run's own `perf/actor_train_s`
and `weight_sync/seconds` (the in-situ sync), and each method's sync as a share of actor_train.
Timings on a shared 2-core machine are noisy: every method runs in the same process, interleaved.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slime.backends.weight_sync.transport import (DistributedTransport, EngineSet, TensorTransport,
                                                  encode_safetensors_payload)
from slime.backends.sglang_utils.http_client import ClientTimeouts
from slime.backends.sglang_utils.launcher import launch_engine
from slime.backends.sglang_utils.named_tensors import deserialize_named_tensors
from slime.config import defaults_namespace
from slime.utils.ports import find_free_port
from slime.utils.security import ApiKey, use_key

METHODS = ("old", "shm", "distributed")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=8, help="engines on this host (the demo runs 8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpoint", type=str, default=None, help="HF dir (default: the demo's tiny Qwen3)")
    parser.add_argument("--demo-metrics", type=str, default=None, help="metrics.jsonl of a make demo run")
    parser.add_argument("--json", type=str, default=None, help="also write the results here")
    return parser.parse_args(argv)


def exported_weights(checkpoint: str) -> tuple[list[tuple[str, torch.Tensor]], float]:
    """The HF tensors a sync pushes, from megatron's export on one gloo rank, and the export's seconds."""
    import torch.distributed as dist
    import transformers

    from slime.backends.megatron_utils.model import build_gpt_model
    from slime.backends.megatron_utils.parallel import init_model_parallel
    from slime_plugins.models.hf_weights import export_hf_weights, load_hf_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    args = defaults_namespace(tensor_model_parallel_size=1, seed=1)
    init_model_parallel(args)
    hf_config = transformers.AutoConfig.from_pretrained(checkpoint)
    model = build_gpt_model(args, hf_config)
    load_hf_weights([model], checkpoint, hf_config)
    start = time.perf_counter()
    named = [(name, tensor.clone()) for name, tensor in export_hf_weights([model], hf_config)]
    return named, time.perf_counter() - start


def old_format_split(named) -> dict[str, float]:
    """Encode, decode and copy of the old format, alone in this process (no HTTP, no contention)."""
    start = time.perf_counter()
    payload = encode_safetensors_payload(named)
    encode = time.perf_counter() - start
    start = time.perf_counter()
    decoded = deserialize_named_tensors(payload.serialized_per_tp_rank[0])
    decode = time.perf_counter() - start
    targets = [torch.empty_like(t) for _, t in named]
    start = time.perf_counter()
    for target, (_, tensor) in zip(targets, decoded):
        target.copy_(tensor)
    copy = time.perf_counter() - start
    return {"encode_s": encode, "decode_s": decode, "copy_s": copy,
            "json_mb": len(payload.serialized_per_tp_rank[0]) / 1e6}


def push_old(engines: EngineSet, named, version: str) -> None:
    payload = encode_safetensors_payload(named)
    engines.each(lambda c: c.update_weights_from_serialized(list(payload.serialized_per_tp_rank),
                                                            weight_version=version, load_format=payload.load_format))


def timed_push(method: str, engines: EngineSet, transports: dict, named, version: str) -> float:
    start = time.perf_counter()
    engines.begin_session()
    try:
        if method == "old":
            push_old(engines, named, version)
        else:
            transports[method].send(0, named, version=version, flush_cache=True)
    finally:
        engines.end_session()
    seconds = time.perf_counter() - start
    versions = engines.each(lambda c: c.weight_version())
    assert versions == [version] * len(versions), f"{method}: engines report {versions}, pushed {version}"
    return seconds


def demo_figures(path: str) -> dict[str, float]:
    events = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    train = [e["perf/actor_train_s"] for e in events if e["event"] == "train" and "perf/actor_train_s" in e]
    sync = [e["weight_sync/seconds"] for e in events if e["event"] == "weight_sync"]
    nbytes = [e["weight_sync/bytes"] for e in events if e["event"] == "weight_sync"]
    return {"actor_train_s": statistics.median(train), "insitu_sync_s": statistics.median(sync),
            "insitu_bytes": statistics.median(nbytes), "rollouts": len(train)}


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    torch.set_num_threads(1)
    workdir = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    checkpoint = opts.checkpoint
    if checkpoint is None:
        from slime.tools.tiny_checkpoint import write_tiny_checkpoint

        checkpoint = str(write_tiny_checkpoint(workdir / "tiny-qwen3"))
    named, export_s = exported_weights(checkpoint)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    launch_args = defaults_namespace(seed=1, fence_timeout=120.0)
    use_key(ApiKey.generate())  # the engines require it; every push sends it
    handles = [launch_engine("embedded", launch_args, i, 0, checkpoint, startup_timeout_s=600,
                             log_dir=str(workdir / "logs"), num_threads=1) for i in range(opts.engines)]
    engines = EngineSet(tuple(h.url for h in handles), ClientTimeouts(weight_update=600.0))
    transports = {"shm": TensorTransport(engines, "embedded", 1),
                  "distributed": DistributedTransport(engines, 1, backend="gloo", timeout_s=120.0)}
    try:
        seconds = {m: [] for m in METHODS}
        for repeat in range(opts.repeats + 1):  # round 0 warms up (and forms the distributed group)
            for method in METHODS:
                elapsed = timed_push(method, engines, transports, named, f"{method}-{repeat}")
                if repeat:
                    seconds[method].append(elapsed)
    finally:
        transports["distributed"].close()
        engines.close()
        for handle in handles:
            handle.stop()
    report(opts, nbytes, export_s, old_format_split(named), seconds)


def report(opts, nbytes: int, export_s: float, split: dict, seconds: dict) -> None:
    demo = demo_figures(opts.demo_metrics) if opts.demo_metrics else None
    medians = {m: statistics.median(v) for m, v in seconds.items()}
    print(f"weights: {nbytes / 1e6:.1f} MB to {opts.engines} embedded engines, median of {opts.repeats} pushes")
    print(f"export (megatron -> HF, one rank): {export_s:.3f} s")
    print(f"old format alone: encode {split['encode_s']:.3f} s, decode {split['decode_s']:.3f} s, "
          f"copy {split['copy_s']:.3f} s per engine, JSON body {split['json_mb']:.1f} MB")
    header = f"{'method':<12} {'sync s':>8} {'GB/s/engine':>12} {'vs old':>8}"
    if demo:
        header += f" {'sync/actor_train':>17}"
    print(header)
    for method in METHODS:
        row = (f"{method:<12} {medians[method]:>8.3f} {nbytes / 1e9 / medians[method]:>12.2f} "
               f"{medians['old'] / medians[method]:>7.1f}x")
        if demo:
            row += f" {medians[method] / demo['actor_train_s']:>16.1%}"
        print(row)
    if demo:
        print(f"demo run ({demo['rollouts']} rollouts): actor_train {demo['actor_train_s']:.2f} s, in-situ "
              f"weight_sync {demo['insitu_sync_s']:.2f} s for {demo['insitu_bytes'] / 1e6:.1f} MB "
              f"({demo['insitu_sync_s'] / demo['actor_train_s']:.1%} of actor_train)")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"bytes": nbytes, "engines": opts.engines, "export_s": export_s,
                                               "old_split": split, "seconds": seconds, "demo": demo}, indent=1))


if __name__ == "__main__":
    main()
