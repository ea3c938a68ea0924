"""What a trainer process holds on its GPU outside PyTorch's caching allocator, item by item.

    python benchmarks/footprint_gpu.py [--json out.json] [--max-ctas 1]

One fresh process on an otherwise idle GPU takes, in order, what a trainer rank takes: the CUDA context,
cuBLAS (bf16 and fp32 GEMMs, forward and backward), SDPA attention (cuDNN / flash, fwd+bwd), an NCCL
communicator (world of one, all-reduce), then more NCCL groups as megatron's parallel_state makes
(one per parallel dimension). After each step the allocator's cache is emptied, so the device's used
memory (cudaMemGetInfo) minus the allocator's reserved bytes is what the step left outside it: what a
colocated sleep that only empties the allocator cannot give back.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

GIB = 1024**3


def device_used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


def smi_used_gib() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, timeout=30).stdout
    return float(out.split()[0]) / 1024


def settle() -> dict[str, float]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    used = device_used_gib()
    reserved = torch.cuda.memory_reserved() / GIB
    return {"device_used_gib": used, "allocator_reserved_gib": reserved, "outside_allocator_gib": used - reserved}


def gemms() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(4096, 4096, device="cuda", dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()


def attention() -> None:
    q = torch.randn(1, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True).sum().backward()


def nccl_options(max_ctas: int):
    """The trainer's options for a communicator of one rank (slime/distributed/communicator_config.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from slime.distributed.communicator_config import world_group_options

    return world_group_options(1, max_ctas)


def nccl_world(max_ctas: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("FOOTPRINT_PORT", "29655"),
                      RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0),
                            pg_options=nccl_options(max_ctas))
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)


def nccl_groups(count: int, max_ctas: int) -> None:
    for _ in range(count):
        group = dist.new_group([0], backend="nccl", pg_options=nccl_options(max_ctas))
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t, group=group)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--groups", type=int, default=8, help="extra NCCL groups (megatron makes one per dimension)")
    parser.add_argument("--max-ctas", type=int, default=0,
                        help="NCCL channels per communicator, as the trainer sets for groups of one rank "
                             "(--single-rank-group-max-ctas); 0: NCCL's default")
    opts = parser.parse_args(argv)
    before = smi_used_gib()  # before this process has a context
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    steps = {"context": settle()}
    gemms()
    steps["cublas"] = settle()
    attention()
    steps["attention"] = settle()
    nccl_world(opts.max_ctas)
    steps["nccl_world"] = settle()
    nccl_groups(opts.groups, opts.max_ctas)
    steps[f"nccl_{opts.groups}_groups"] = settle()
    previous = before
    rows = []
    for name, step in steps.items():
        rows.append({"step": name, **step, "added_outside_gib": step["device_used_gib"] - previous})
        previous = step["device_used_gib"]
    for row in rows:
        print(f"FOOTPRINT {row['step']:<14} outside allocator {row['outside_allocator_gib']:.3f} GiB "
              f"(device used +{row['added_outside_gib']:.3f}), allocator reserved {row['allocator_reserved_gib']:.3f} GiB")
    print(f"FOOTPRINT device used before this process {before:.3f} GiB; nvidia-smi now {smi_used_gib():.3f} GiB")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"before_gib": before, "steps": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
