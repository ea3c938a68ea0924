"""The weight-sync proof's digest on a GPU: equal to the host's, and how fast.

    python benchmarks/bench_tensor_digest_gpu.py [--checkpoint DIR] [--repeats 5] [--json OUT]

1. Agreement: tensors of every dtype the engines hold (fp32, bf16, fp16, int64), odd byte counts, views at odd
   offsets, one over GROUP_BYTES (digested in place), each digested on the GPU (one compiled kernel per group)
   and on the host (numpy): every digest must be equal, or the proof would fail between a GPU trainer and a CPU
   engine.
2. Throughput: the tensors of a checkpoint (default: random tensors shaped like a Qwen3-0.6B body, bf16) digested
   as the proof does after a push, timed after one warm-up call (the first compiles): seconds per pass and GB/s,
   beside the GPU's device-to-device copy bandwidth.
Prints one line `DIGEST_GPU agree=... seconds=... GBps=... copy_GBps=...`.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from slime.backends.sglang_utils import tensor_digest


def agreement(device: torch.device) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    cases = {
        "fp32": torch.randn(1000, 333, generator=generator),
        "bf16": torch.randn(4096, 1024, generator=generator).bfloat16(),
        "fp16 odd bytes": torch.randn(7, generator=generator).half(),
        "int64": torch.randint(-2**62, 2**62, (5000,), generator=generator),
        "empty": torch.zeros(0),
        "scalar": torch.tensor(3.5),
        "transposed": torch.randn(64, 48, generator=generator).t(),
        "over a group": torch.randn(tensor_digest.GROUP_BYTES // 4 + 12345, generator=generator).bfloat16(),
    }
    on_gpu = [t.to(device) for t in cases.values()]
    on_gpu.append(on_gpu[1].reshape(-1)[3:])  # a view at an odd offset
    host = [t.cpu() for t in on_gpu]
    names = [*cases, "odd offset"]
    gpu_digests, host_digests = tensor_digest.tensor_digests(on_gpu), tensor_digest.tensor_digests(host)
    return [name for name, a, b in zip(names, gpu_digests, host_digests) if a != b]


def body_shapes(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=3072, vocab=151936):
    shapes = [("embed", (vocab, hidden))]
    for _ in range(layers):
        shapes += [("q", (heads * head_dim, hidden)), ("k", (kv_heads * head_dim, hidden)),
                   ("v", (kv_heads * head_dim, hidden)), ("o", (hidden, heads * head_dim)),
                   ("gate", (ffn, hidden)), ("up", (ffn, hidden)), ("down", (hidden, ffn)),
                   ("norm1", (hidden,)), ("norm2", (hidden,)), ("qn", (head_dim,)), ("kn", (head_dim,))]
    return shapes + [("norm", (hidden,))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="an HF safetensors checkpoint whose tensors are digested")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    differing = agreement(device)
    if args.checkpoint:
        from safetensors.torch import load_file
        import glob

        tensors = [t.to(device) for path in sorted(glob.glob(f"{args.checkpoint}/*.safetensors"))
                   for t in load_file(path).values()]
    else:
        tensors = [torch.randn(shape, device=device, dtype=torch.bfloat16) for _, shape in body_shapes()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    tensor_digest.tensor_digests(tensors)  # compiles
    torch.cuda.synchronize()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        tensor_digest.tensor_digests(tensors)
        times.append(time.perf_counter() - start)
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    copy = torch.empty_like(flat)
    torch.cuda.synchronize()
    start = time.perf_counter()
    copy.copy_(flat)
    torch.cuda.synchronize()
    copy_gbps = 2 * nbytes / 1e9 / (time.perf_counter() - start)  # read + write
    seconds = sorted(times)[len(times) // 2]
    result = {"agree": not differing, "differing": differing, "tensors": len(tensors), "bytes": nbytes,
              "seconds": seconds, "GBps": nbytes / 1e9 / seconds, "copy_GBps": copy_gbps,
              "device": torch.cuda.get_device_name(device)}
    print(f"DIGEST_GPU agree={result['agree']} differing={differing} tensors={len(tensors)} "
          f"GB={nbytes / 1e9:.3f} seconds={seconds:.4f} GBps={result['GBps']:.0f} copy_GBps={copy_gbps:.0f} "
          f"({result['device']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
