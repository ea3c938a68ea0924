"""GPU check of the pieces gpt-oss and Kimi-Linear add, on the CUDA paths CPU tests cannot take:

- the Kimi delta rule (slime/models/kda_rule.py) torch.compile'd on CUDA, fp32 and bf16, packed sequences: outputs
  and every input's gradient against the fp64 chunked rule on the CPU (itself tested against the recurrence);
  then a Kimi-Linear-48B-shaped layer's rule (4096 tokens, 32 heads of 128) timed, forward + backward, with its
  peak memory;
- the sink attention (slime/models/attention_sinks.sink_chunk_attention) in bf16 against fp32, windowed and not;
- the grouped experts with biases (gpt-oss's) on torch's grouped GEMM against their per-expert loop, bf16.

    python benchmarks/check_new_families_gpu.py
Prints NEW_FAMILIES lines: the largest relative difference of each check, milliseconds and GiB of the timed rule.
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.models.gated_delta_rule import l2norm  # noqa: E402
from slime.models.kda_rule import chunk_kda_rule  # noqa: E402


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want.double().cpu()).abs().max() / want.double().abs().max().clamp_min(1e-12))


def kda_inputs(tokens: int, heads: int, dim: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(1, tokens, heads, dim, generator=generator, dtype=torch.float64)) for _ in range(2))
    v = torch.randn(1, tokens, heads, dim, generator=generator, dtype=torch.float64)
    g = -torch.rand(1, tokens, heads, dim, generator=generator, dtype=torch.float64)
    beta = torch.rand(1, tokens, heads, generator=generator, dtype=torch.float64)
    return [q, k, v, g, beta]


def check_kda() -> None:
    inputs = kda_inputs(700, 4, 64)
    cu = torch.tensor([0, 300, 301, 700])
    weights = torch.randn(1, 700, 4, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    leaves = [x.clone().requires_grad_() for x in inputs]
    out, _ = chunk_kda_rule(*leaves, cu_seqlens=cu)
    want = [out.detach(), *torch.autograd.grad((out * weights).sum(), leaves)]
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [x.to("cuda", dtype).requires_grad_() for x in inputs]
        out, _ = chunk_kda_rule(*leaves, cu_seqlens=cu.cuda())
        got = [out.detach(), *torch.autograd.grad((out * weights.cuda().to(dtype)).sum(), leaves)]
        worst = max(relative(a, b) for a, b in zip(got, want))
        print(f"NEW_FAMILIES kda_rule {dtype} compiled vs fp64: max relative difference {worst:.2e}")


def time_kda(tokens: int = 4096, heads: int = 32, dim: int = 128) -> None:
    leaves = [x.to("cuda", torch.bfloat16).requires_grad_() for x in kda_inputs(tokens, heads, dim)]
    for warm in range(3):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out, _ = chunk_kda_rule(*leaves)
        out.float().square().sum().backward()
        torch.cuda.synchronize()
        if warm == 2:
            print(f"NEW_FAMILIES kda_rule {tokens} tokens x {heads} heads of {dim}, bf16: "
                  f"{1e3 * (time.perf_counter() - start):.1f} ms forward + backward, "
                  f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB peak")


def check_sinks() -> None:
    from slime.models.attention_sinks import sink_chunk_attention

    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, h, 64, generator=generator) for n, h in ((512, 8), (1024, 2), (1024, 2)))
    sinks = torch.randn(8, generator=generator)
    for window in (None, 128):
        want = sink_chunk_attention(q, k, v, sinks, 512, window, scale=0.125, dropout_p=0.0)
        got = sink_chunk_attention(*(x.cuda().bfloat16() for x in (q, k, v, sinks)), 512, window, scale=0.125,
                                   dropout_p=0.0)
        print(f"NEW_FAMILIES sink attention bf16 window {window}: max relative difference {relative(got, want):.2e}")


def check_biased_experts() -> None:
    from slime.models.grouped_experts import grouped_linear, grouped_mm_usable

    generator = torch.Generator().manual_seed(3)
    counts = torch.tensor([100, 0, 37, 300])
    x = torch.randn(int(counts.sum()), 256, generator=generator).cuda().bfloat16()
    weights = [torch.randn(512, 256, generator=generator).cuda().bfloat16() * 0.05 for _ in counts]
    if not grouped_mm_usable(x):
        print("NEW_FAMILIES biased experts: torch's grouped GEMM does not serve this GPU (the loop runs)")
        return
    biases = torch.stack([torch.randn(512, generator=generator) for _ in counts]).cuda().bfloat16()
    rows = torch.repeat_interleave(biases, counts.cuda(), dim=0, output_size=x.shape[0])
    grouped = grouped_linear(x, counts, weights, use_grouped_mm=True, into_main_grad=False) + rows
    loop = grouped_linear(x, counts, weights, use_grouped_mm=False, into_main_grad=False) + rows
    print(f"NEW_FAMILIES biased experts grouped GEMM vs loop, bf16: max relative difference "
          f"{relative(grouped, loop):.2e}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    check_kda()
    time_kda()
    check_sinks()
    check_biased_experts()
