"""The gated delta rule on one GPU: the eager torch chunked rule, its compiled form and fla's Triton kernel.

    python benchmarks/bench_gated_delta_gpu.py [--tokens 8192 --seqs 4 --heads 32 --dim 128 --iters 10]

One Qwen3.5-4B-shaped DeltaNet layer's kernel call: B=1, `--tokens` packed as `--seqs` equal sequences
(cu_seqlens), `--heads` value heads, Dk = Dv = `--dim`. For each implementation (slime/models/gated_delta_rule.py,
forced through KERNEL_OVERRIDE): the first call's seconds (the compile for "compiled"), the median forward and
forward+backward milliseconds in bf16 (q, k, v, beta bf16; g fp32, as the layer passes them), the peak memory,
and the max abs difference of the output and final state from the fp64 token-by-token recurrence, for fp32
and for bf16 inputs; then the max abs differences between implementations (outputs and gradients).
fla's backward is tried; where it refuses (Hopper with Triton < 3.7.1) its message is printed, and the row
"fla-unguarded" lifts that refusal to show what the refused backward would cost and how far its gradients are
from the eager rule's (a measurement only: the project never runs it).
`--device cpu` runs the eager rule alone on a small shape: a logic check of this script.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from slime.models import gated_delta_rule as gdr


# fla with its Hopper/Triton refusal lifted: how fast (and how wrong) the backward it refuses would be. Benchmark only.
UNGUARDED = "fla-unguarded"


def lift_fla_guard() -> None:
    import fla.ops.common.chunk_o as chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--impls", default=f"torch,compiled,fla,{UNGUARDED}")
    return parser.parse_args(argv)


def make_inputs(args, dtype: torch.dtype, seed: int = 0) -> dict:
    """Layer-like inputs: l2-normalised q, k; g = -softplus(.) as the layer's decay; beta = sigmoid(.)."""
    gen = torch.Generator(device=args.device).manual_seed(seed)
    shape = (1, args.tokens, args.heads)

    def randn(*s):
        return torch.randn(*s, generator=gen, device=args.device, dtype=torch.float32)

    q = gdr.l2norm(randn(*shape, args.dim))
    k = gdr.l2norm(randn(*shape, args.dim))
    v = randn(*shape, args.dim)
    g = -F.softplus(randn(*shape) - 2.0)
    beta = randn(*shape).sigmoid()
    state = randn(args.seqs, args.heads, args.dim, args.dim) * 0.1
    bounds = torch.linspace(0, args.tokens, args.seqs + 1).round().long()
    out = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta.to(dtype), initial_state=state)
    out["cu_seqlens"] = bounds.to(device=args.device, dtype=torch.int32)
    return out


def call(impl: str, inputs: dict, grad: bool = False):
    gdr.KERNEL_OVERRIDE = "fla" if impl == UNGUARDED else impl
    args = {k: (v.detach().requires_grad_() if grad and k not in ("cu_seqlens",) else v) for k, v in inputs.items()}
    out, final = gdr.chunk_gated_delta_rule(args["q"], args["k"], args["v"], args["g"], args["beta"],
                                            initial_state=args["initial_state"], output_final_state=True,
                                            cu_seqlens=args["cu_seqlens"])
    if not grad:
        return out, final, None
    gen = torch.Generator(device=out.device).manual_seed(7)
    loss = (out.float() * torch.randn(out.shape, generator=gen, device=out.device)).sum() + final.sum()
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    grads = torch.autograd.grad(loss, [args[n] for n in names])
    return out, final, dict(zip(names, grads))


def timed_ms(fn, iters: int, device: str) -> float:
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def short(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"


def measure(impl: str, args, truth, bf16: dict, fp32: dict) -> dict:
    row = {"impl": impl}
    if impl == UNGUARDED:
        lift_fla_guard()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            call(impl, bf16)
        sync()
    except Exception as err:  # noqa: BLE001 - a benchmark reports what an implementation refuses
        row["error"] = short(err)
        return row
    row["first_call_s"] = time.perf_counter() - t0
    with torch.no_grad():
        row["fwd_ms"] = timed_ms(lambda: call(impl, bf16), args.iters, args.device)
    for name, inputs in (("fp32", fp32), ("bf16", bf16)):
        try:
            with torch.no_grad():
                out, final, _ = call(impl, inputs)
            row[f"{name}_out_err"], row[f"{name}_state_err"] = diff(out, truth[0]), diff(final, truth[1])
            row[f"{name}_out"], row[f"{name}_final"] = out, final
        except Exception as err:  # noqa: BLE001
            row[f"{name}_error"] = short(err)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        t0 = time.perf_counter()
        row["grads_bf16"] = call(impl, bf16, grad=True)[2]
        sync()
        row["first_bwd_s"] = time.perf_counter() - t0
        row["fwd_bwd_ms"] = timed_ms(lambda: call(impl, bf16, grad=True), args.iters, args.device)
        if args.device == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception as err:  # noqa: BLE001
        row["bwd_error"] = short(err)
    if impl == "compiled":  # another packing of the same token count: dynamic shapes, no recompile expected
        other = dict(bf16, cu_seqlens=torch.tensor([0, 100, 3000, args.tokens - 700, args.tokens],
                                                   dtype=torch.int32, device=args.device))
        other["initial_state"] = bf16["initial_state"][:1].expand(4, -1, -1, -1).contiguous()
        t0 = time.perf_counter()
        call(impl, other, grad=True)
        sync()
        row["new_packing_s"] = time.perf_counter() - t0
    return row


def conv_check(args, fp32: dict) -> None:
    """The packed causal conv on the device: agreement with the CPU and its cost against one plain conv1d."""
    channels = 2 * args.heads * args.dim  # q, k (16 key heads at Qwen3.5-4B) and v: about the layer's conv width
    gen = torch.Generator(device=args.device).manual_seed(3)
    x = torch.randn(1, args.tokens, channels, generator=gen, device=args.device, dtype=torch.bfloat16)
    weight = torch.randn(channels, 4, generator=gen, device=args.device, dtype=torch.bfloat16)
    cu = fp32["cu_seqlens"]
    out = gdr.causal_conv1d(x.float(), weight.float(), cu_seqlens=cu)
    cpu = gdr.causal_conv1d(x.cpu().float(), weight.cpu().float(), cu_seqlens=cu.cpu())
    x.requires_grad_()

    def packed():
        gdr.causal_conv1d(x, weight, cu_seqlens=cu).sum().backward()

    def plain():
        gdr.causal_conv1d(x, weight).sum().backward()

    print(f"causal_conv1d [1, {args.tokens}, {channels}] K=4: fp32 max abs diff from the CPU "
          f"{diff(out, cpu.to(out.device)):.2e}; bf16 fwd+bwd packed {timed_ms(packed, args.iters, args.device):.3f} ms, "
          f"unpacked {timed_ms(plain, args.iters, args.device):.3f} ms")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    impls = ["torch"] if args.device == "cpu" else args.impls.split(",")
    fp32, bf16 = make_inputs(args, torch.float32), make_inputs(args, torch.bfloat16)
    if args.device == "cuda":
        import triton

        print(f"device {torch.cuda.get_device_name()} capability {torch.cuda.get_device_capability()} "
              f"torch {torch.__version__} triton {triton.__version__}")
        gdr.KERNEL_OVERRIDE = None
        print(f"auto choice: {gdr.active_kernel(torch.device('cuda'))}")
    print(f"shape: B=1 T={args.tokens} as {args.seqs} sequences, H={args.heads}, Dk=Dv={args.dim}")
    t0 = time.perf_counter()
    with torch.no_grad():
        truth = gdr.recurrent_gated_delta_rule(*(fp32[n].double() for n in ("q", "k", "v", "g", "beta")),
                                               initial_state=fp32["initial_state"].double(),
                                               output_final_state=True, cu_seqlens=fp32["cu_seqlens"])
    print(f"fp64 token-by-token reference: {time.perf_counter() - t0:.1f} s")
    conv_check(args, fp32)
    print(f"\n{'impl':13} {'first s':>8} {'fwd ms':>8} {'fwd+bwd ms':>10} {'peak GiB':>8} "
          f"{'fp32 out err':>12} {'fp32 state':>10} {'bf16 out err':>12} {'bf16 state':>10}")
    rows = []
    for impl in impls:  # each row printed as soon as it is measured
        rows.append(measure(impl, args, truth, bf16, fp32))
        print_row(rows[-1])
    print("\nbetween implementations (max abs diff; gradients of the bf16 call, per input, over its largest):")
    done = [r for r in rows if "error" not in r]
    for i, a in enumerate(done):
        for b in done[i + 1:]:
            print(f"  {a['impl']} vs {b['impl']}: {compare(a, b)}")


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['impl']:13} {r['error']}")
        return
    cells = [f"{r.get('first_call_s', float('nan')):8.2f}", f"{r['fwd_ms']:8.2f}",
             f"{r.get('fwd_bwd_ms', float('nan')):10.2f}", f"{r.get('peak_gib', float('nan')):8.2f}"]
    cells += [f"{r.get(k, float('nan')):12.2e}" if "out" in k else f"{r.get(k, float('nan')):10.2e}"
              for k in ("fp32_out_err", "fp32_state_err", "bf16_out_err", "bf16_state_err")]
    print(f"{r['impl']:13} " + " ".join(cells))
    for key in ("fp32_error", "bf16_error", "bwd_error"):
        if key in r:
            print(f"{'':13} {key}: {r[key]}")
    if "first_bwd_s" in r:
        print(f"{'':13} first fwd+bwd call: {r['first_bwd_s']:.2f} s"
              + (f"; a new packing's first fwd+bwd: {r['new_packing_s']:.2f} s" if "new_packing_s" in r else ""),
              flush=True)


def compare(a: dict, b: dict) -> str:
    parts = []
    for dt in ("fp32", "bf16"):
        if f"{dt}_out" in a and f"{dt}_out" in b:
            parts.append(f"{dt} out {diff(a[f'{dt}_out'], b[f'{dt}_out']):.2e} "
                         f"state {diff(a[f'{dt}_final'], b[f'{dt}_final']):.2e}")
    if a.get("grads_bf16") and b.get("grads_bf16"):
        ga, gb = a["grads_bf16"], b["grads_bf16"]
        parts.append("grads " + " ".join(f"{n} {diff(ga[n], gb[n]):.1e}/{gb[n].abs().max().item():.1e}" for n in ga))
    return "; ".join(parts)


if __name__ == "__main__":
    main()
