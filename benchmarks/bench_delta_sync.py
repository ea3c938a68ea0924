"""Delta against full weight pushes to separate embedded engines: bytes and seconds per sync, side by side.

    python benchmarks/bench_delta_sync.py [--engines 2] [--syncs 4] [--lr 1e-6] [--encoding xor] [--checksum adler32]

The demo's tiny Qwen3 (`make demo`'s checkpoint) trains with torch's Adam on random token batches
(transformers' model, fp32 master weights), one optimizer step per sync. After each step its weights are
pushed to N running embedded engines over the broadcast group (gloo), as a separate-engine run does:
once in full (`--update-weight-mode full`) and once as a delta (`--update-weight-mode delta`), pushed
alternately to the same engines, which end each sync on the same weights. Two push dtypes: fp32 (the
CPU demo's) and bf16 (a `--bf16` trainer's push), where Adam's small steps vanish in rounding for most
positions. The first delta push of a run is full (it seeds the baseline) and is not counted.

Printed per dtype: bytes and seconds per sync (median over the syncs) for full and delta, the share of
positions that changed, and the delta's bytes and seconds as a share of the full push's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from slime.backends.weight_sync.factory import build_transport  # noqa: E402
from slime.config.weight_sync import DeltaOptions  # noqa: E402
from slime.backends.weight_sync.transport import EngineSet
from slime.backends.sglang_utils.http_client import ClientTimeouts  # noqa: E402
from slime.backends.sglang_utils.launcher import launch_engine  # noqa: E402
from slime.config import defaults_namespace  # noqa: E402
from slime.utils.security import ApiKey, use_key  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--syncs", type=int, default=4, help="optimizer steps, each followed by both pushes")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--encoding", default="xor", choices=["xor", "overwrite"])
    parser.add_argument("--checksum", default="adler32", choices=["xxh3-128", "blake3", "adler32"])
    parser.add_argument("--bucket-mb", type=int, default=512, help="--update-weight-buffer-size in MiB")
    parser.add_argument("--checkpoint", default=None, help="HF dir (default: the demo's tiny Qwen3)")
    return parser.parse_args(argv)


def buckets(named, bucket_bytes: int):
    out, size = [[]], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


def push(transport, named, version: str, bucket_bytes: int) -> tuple[int, float]:
    """One sync: a weight-update session, every bucket; (bytes over the group, seconds)."""
    start = time.perf_counter()
    transport.engines.begin_session()
    sent = 0
    try:
        parts = buckets(named, bucket_bytes)
        for index, bucket in enumerate(parts):
            last = index == len(parts) - 1
            result = transport.send(index, bucket, version=version if last else None, flush_cache=last)
            sent += result if isinstance(result, int) else sum(t.numel() * t.element_size() for _, t in bucket)
    finally:
        transport.engines.end_session()
    return sent, time.perf_counter() - start


class Trainer:
    """The tiny model with Adam; `step` is one optimizer step on a random batch."""

    def __init__(self, checkpoint: str, lr: float):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.vocab = self.model.config.vocab_size
        self.generator = torch.Generator().manual_seed(0)
        self.tied = bool(self.model.config.tie_word_embeddings)

    def step(self) -> None:
        tokens = torch.randint(0, self.vocab, (2, 64), generator=self.generator)
        loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def weights(self, dtype: torch.dtype):
        return [(name, tensor.detach().to(dtype).clone()) for name, tensor in self.model.state_dict().items()
                if name != "lm_head.weight" or not self.tied]


def changed_share(before, after) -> float:
    changed = total = 0
    for (_, old), (_, new) in zip(before, after):
        bits = {2: torch.int16, 4: torch.int32}[old.element_size()]
        changed += int((old.reshape(-1).view(bits) != new.reshape(-1).view(bits)).sum())
        total += old.numel()
    return changed / total


def run_dtype(dtype, opts, engines, checkpoint) -> dict:
    trainer = Trainer(checkpoint, opts.lr)
    bucket_bytes = opts.bucket_mb * 1024**2
    rows = {"full": [], "delta": [], "changed": []}
    full = build_transport("distributed", engines, engine_kind="embedded", engine_tp_size=1, timeout_s=300,
                           pp_rank=0)
    delta = build_transport("distributed", engines, engine_kind="embedded", engine_tp_size=1, timeout_s=300,
                            pp_rank=1, delta=DeltaOptions(opts.encoding, opts.checksum))
    try:
        previous = trainer.weights(dtype)
        push(delta, previous, "seed", bucket_bytes)  # seeds the delta's baseline: a full push
        for sync in range(opts.syncs):
            trainer.step()
            named = trainer.weights(dtype)
            rows["changed"].append(changed_share(previous, named))
            # delta first: it applies to the previous sync's weights, which the full push then rewrites as they are
            rows["delta"].append(push(delta, named, f"delta-{sync}", bucket_bytes))
            rows["full"].append(push(full, named, f"full-{sync}", bucket_bytes))
            previous = named
        assert delta.fallbacks == 0, "the engines took the full push of the same weights: every delta must match"
    finally:
        full.close()
        delta.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    torch.set_num_threads(1)
    workdir = Path(tempfile.mkdtemp(prefix="bench-delta-sync-"))
    checkpoint = opts.checkpoint
    if checkpoint is None:
        from slime.tools.tiny_checkpoint import write_tiny_checkpoint

        checkpoint = str(write_tiny_checkpoint(workdir / "tiny-qwen3"))
    use_key(ApiKey.generate())
    launch_args = defaults_namespace(seed=1, fence_timeout=300.0)
    handles = [launch_engine("embedded", launch_args, i, 0, checkpoint, startup_timeout_s=600,
                             log_dir=str(workdir / "logs"), num_threads=1) for i in range(opts.engines)]
    engines = EngineSet(tuple(h.url for h in handles), ClientTimeouts(weight_update=600.0))
    try:
        results = {name: run_dtype(dtype, opts, engines, checkpoint)
                   for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    finally:
        engines.close()
        for handle in handles:
            handle.stop()
    print(f"{opts.engines} embedded engines, gloo broadcast, Adam lr {opts.lr:g}, encoding {opts.encoding}, "
          f"checksum {opts.checksum}, median of {opts.syncs} syncs")
    header = (f"{'push':<5} {'changed':>8} | {'full MB':>8} {'full s':>7} | {'delta MB':>9} {'delta s':>8} | "
              f"{'bytes':>6} {'time':>6}")
    print(header)
    print("-" * len(header))
    for name, rows in results.items():
        full_b, full_s = (statistics.median(v) for v in zip(*rows["full"]))
        delta_b, delta_s = (statistics.median(v) for v in zip(*rows["delta"]))
        print(f"{name:<5} {statistics.median(rows['changed']):>7.1%} | {full_b / 1e6:>8.1f} {full_s:>7.2f} | "
              f"{delta_b / 1e6:>9.1f} {delta_s:>8.2f} | {delta_b / full_b:>5.0%} {delta_s / full_s:>5.0%}",
              flush=True)


if __name__ == "__main__":
    main()
