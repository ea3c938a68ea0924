"""GPU check of the sliding-window core attention (slime/models/cp_attention.attend_windowed) on bf16 CUDA inputs,
the path CPU tests cannot take (flash-attn's varlen window_size where flash-attn is installed, else a band-masked
SDPA call per chunk): a packed micro-batch of three sequences, each CP rank of a zig-zag split emulated in one
process (its local queries, the keys all ranks would gather), against an fp32 band-masked reference of the whole
sequences; outputs and the queries' gradient. Then the windowed call timed against the full causal one.

    python benchmarks/check_sliding_window_gpu.py [--window 1024] [--heads 16 --kv-heads 4 --head-dim 128]
Prints SWA_CHECK lines (max relative difference per CP rank; milliseconds of each path).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.models.cp_attention import (attend_causal, attend_windowed, attention_plan,  # noqa: E402
                                       flash_attn_varlen_func, zigzag_positions)


def reference(q, k, v, window: int, scale: float) -> torch.Tensor:
    """One whole sequence in fp32: query i sees keys i - window < j <= i."""
    pos = torch.arange(q.shape[0], device=q.device)
    gap = pos.unsqueeze(1) - pos.unsqueeze(0)
    mask = (gap >= 0) & (gap < window)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().transpose(0, 1),
                                         v.float().transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def local(tensor_per_seq: list[torch.Tensor], lengths, cp: int, rank: int) -> torch.Tensor:
    parts = [t[zigzag_positions(n, cp, rank).to(t.device)] if cp > 1 else t for t, n in zip(tensor_per_seq, lengths)]
    return torch.cat(parts)


def rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def timed(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    a = p.parse_args()
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    lengths = (4096, 2048, 6144)
    scale = 1.0 / math.sqrt(a.head_dim)
    q = [torch.randn(n, a.heads, a.head_dim, device=dev, dtype=dt) for n in lengths]
    k = [torch.randn(n, a.kv_heads, a.head_dim, device=dev, dtype=dt) for n in lengths]
    v = [torch.randn(n, a.kv_heads, a.head_dim, device=dev, dtype=dt) for n in lengths]
    want = [reference(*t, a.window, scale) for t in zip(q, k, v)]
    print(f"SWA_CHECK flash_attn={'yes' if flash_attn_varlen_func is not None else 'no'} window={a.window} "
          f"lengths={lengths}")
    for cp in (1, 2):
        keys = torch.cat([local(k, lengths, cp, r) for r in range(cp)])  # what the CP all-gather gives (rank-major)
        values = torch.cat([local(v, lengths, cp, r) for r in range(cp)])
        for rank in range(cp):
            plan = attention_plan(lengths, cp, rank, dev)
            queries = local(q, lengths, cp, rank).requires_grad_()
            out = attend_windowed(queries, keys, values, plan, window=a.window, scale=scale, dropout_p=0.0)
            expected = local(want, lengths, cp, rank)
            grad_out = torch.randn_like(out)
            (grad,) = torch.autograd.grad(out, queries, grad_out)
            ref_queries = queries.detach().float().requires_grad_()
            ref_out = attend_windowed(ref_queries, keys.float(), values.float(), plan, window=a.window, scale=scale,
                                      dropout_p=0.0)  # fp32: the band-masked SDPA path
            (ref_grad,) = torch.autograd.grad(ref_out, ref_queries, grad_out.float())
            print(f"SWA_CHECK cp={cp} rank={rank} out_rel={rel(out, expected):.2e} "
                  f"fp32_path_out_rel={rel(ref_out, expected):.2e} dq_rel={rel(grad, ref_grad):.2e}")
    plan = attention_plan(lengths, 1, 0, dev)
    queries, keys, values = torch.cat(q), torch.cat(k), torch.cat(v)
    full_ms = timed(lambda: attend_causal(queries, keys, values, plan, scale=scale, dropout_p=0.0))
    window_ms = timed(lambda: attend_windowed(queries, keys, values, plan, window=a.window, scale=scale,
                                              dropout_p=0.0))
    print(f"SWA_CHECK forward ms: full_causal={full_ms:.3f} windowed={window_ms:.3f} "
          f"ratio={window_ms / full_ms:.2f}")


if __name__ == "__main__":
    main()
