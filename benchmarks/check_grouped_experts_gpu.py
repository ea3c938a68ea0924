"""GPU check of the grouped experts' GEMMs (slime/models/grouped_experts.py) at a Qwen3-30B-A3B expert layer
(128 experts, hidden 2048, expert width 768, top-8), bf16: torch._grouped_mm against the expert-by-expert loop
over the same layout (outputs and every gradient, experts without tokens included), then both timed fwd+bwd.

    python benchmarks/check_grouped_experts_gpu.py [--tokens 8192]
Prints GROUPED_CHECK lines (max relative difference per tensor; TFLOP/s of each path).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.models.grouped_experts import grouped_linear  # noqa: E402


def expert_mlp(x, counts, probs, w1, w2, grouped: bool):
    h = grouped_linear(x, counts, w1, use_grouped_mm=grouped)
    gate, up = torch.chunk(h, 2, dim=-1)
    act = (torch.nn.functional.silu(gate) * up * probs.unsqueeze(-1)).to(x.dtype)
    return grouped_linear(act, counts, w2, use_grouped_mm=grouped)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--topk", type=int, default=8)
    a = p.parse_args()
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = a.tokens * a.topk
    expert_of_row = torch.randint(0, a.experts - 3, (rows,))  # the last three experts get no token
    counts = torch.bincount(expert_of_row, minlength=a.experts)
    x0 = torch.randn(rows, a.hidden, device=dev, dtype=dt)
    probs0 = torch.rand(rows, device=dev, dtype=torch.float32)
    w1 = [torch.nn.Parameter((0.02 * torch.randn(2 * a.ffn, a.hidden, device=dev)).to(dt)) for _ in range(a.experts)]
    w2 = [torch.nn.Parameter((0.02 * torch.randn(a.hidden, a.ffn, device=dev)).to(dt)) for _ in range(a.experts)]
    gout = torch.randn(rows, a.hidden, device=dev, dtype=dt)

    def run(grouped: bool):
        x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
        out = expert_mlp(x, counts, probs, w1, w2, grouped)
        grads = torch.autograd.grad(out, [x, probs, *w1, *w2], gout)
        return out, grads

    out_g, grads_g = run(True)
    out_l, grads_l = run(False)

    def rel(a_, b_):
        return float((a_.float() - b_.float()).norm() / b_.float().norm().clamp_min(1e-30))

    e = a.experts
    empty = [i for i in range(e) if counts[i] == 0]
    empty_zero = all(float(grads_g[2 + i].abs().max()) == 0.0 and float(grads_g[2 + e + i].abs().max()) == 0.0
                     for i in empty)
    w1_rel = max(rel(grads_g[2 + i], grads_l[2 + i]) for i in range(e) if counts[i])
    w2_rel = max(rel(grads_g[2 + e + i], grads_l[2 + e + i]) for i in range(e) if counts[i])
    print(f"GROUPED_CHECK tokens={a.tokens} rows={rows} experts={e} (empty {empty}): rel diff output "
          f"{rel(out_g, out_l):.2e}, grad x {rel(grads_g[0], grads_l[0]):.2e}, grad probs "
          f"{rel(grads_g[1], grads_l[1]):.2e}, grad fc1 max over experts {w1_rel:.2e}, grad fc2 {w2_rel:.2e}; "
          f"empty experts' weight grads all zero: {empty_zero}", flush=True)

    flops = 3 * 2 * rows * (a.hidden * 2 * a.ffn + a.ffn * a.hidden)
    for name, grouped in (("grouped_mm", True), ("loop", False)):
        for _ in range(2):
            run(grouped)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        n, start = 5, time.perf_counter()
        for _ in range(n):
            run(grouped)
        torch.cuda.synchronize()
        s = (time.perf_counter() - start) / n
        print(f"GROUPED_CHECK {name}: expert MLP fwd+bwd {s * 1e3:.2f} ms, "
              f"{flops / s / 1e12:.0f} TFLOP/s, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)


if __name__ == "__main__":
    main()
