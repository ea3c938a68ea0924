"""The gated delta rule on one GPU: fla's kernels with the project's chunk_bwd_dqkwg against the compiled rule.

    python benchmarks/bench_gated_delta_gpu.py [--tokens 8192 --seqs 4 --dim 128 --iters 10 --budget-s 420]
        [--jobs 32:32/fla-dqkwg 32:32/compiled 16:32/fla-dqkwg 16:32/compiled 32:32/torch 32:32/fla-unguarded]

One Qwen3.5-shaped DeltaNet layer's kernel call: B=1, `--tokens` packed as `--seqs` equal sequences (cu_seqlens),
Dk = Dv = `--dim`; each job is KEY_HEADS:VALUE_HEADS/IMPL (16:32 is Qwen3.5-4B's linear attention: 16 key heads
read by 32 value heads; 32:32 the shape measured before). IMPL is a choice of slime/models/gated_delta_rule.py
forced through KERNEL_OVERRIDE: fla-dqkwg (fla's Triton kernels with the project's chunk_bwd_dqkwg: the auto choice
on Hopper with Triton 3.6), compiled (the project's chunked rule under torch.compile: the previous choice there),
torch (the same rule eager), fla (fla's own kernels: refused in backward on Hopper with Triton 3.6) and
fla-unguarded (fla with that refusal lifted: what the refused kernel would give; a measurement only).

Per job, one ROW line: the first call's seconds (compiles, fla-dqkwg's first-use check), median forward and
forward+backward milliseconds in bf16 (q, k, v, beta bf16; g fp32 as the layer passes them), peak memory, and the
max abs difference of the output and final state from the fp64 token-by-token recurrence (fp32 inputs; bf16
inputs, for the first shape also fp32 calls); one GRADS line: the max abs difference of every gradient (q, k, v,
g, beta, initial state) of the bf16 call from fp64 gradients at the same (bf16-rounded) inputs, over the largest
gradient. fp64 gradients: the project's chunked rule in fp64 (the recurrence's own backward at this size would
keep ~100 GB of states), which equals the recurrence to rounding (its output's distance is printed). Then per
shape: RATIO (compiled / fla-dqkwg fwd+bwd; target >= 5x) and ERRORS (fla-dqkwg's errors against compiled's).
A job that fails prints its error and the next one runs; jobs past `--budget-s` print SKIPPED; the exit code is 0.
`--device cpu` runs the same jobs at a tiny shape (CUDA-only ones print their refusal): a logic check.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.models import gated_delta_bwd  # noqa: E402
from slime.models import gated_delta_rule as gdr  # noqa: E402

UNGUARDED = "fla-unguarded"
# fla-dqkwg with its first-use check skipped: run (once per shape) where the check refused fla-dqkwg, so the run still
# measures its speed and errors
UNCHECKED = "fla-dqkwg-unchecked"
DEFAULT_JOBS = ("32:32/fla-dqkwg", "32:32/compiled", "16:32/fla-dqkwg", "16:32/compiled", "32:32/torch",
                f"32:32/{UNGUARDED}")
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")
_project_dqkwg_calls = [0]


def count_project_dqkwg() -> None:
    """Count the calls fla's registry routes to the project's chunk_bwd_dqkwg (proof the backend ran)."""
    inner = gated_delta_bwd.chunk_bwd_dqkwg

    def counted(*args, **kwargs):
        _project_dqkwg_calls[0] += 1
        return inner(*args, **kwargs)

    gated_delta_bwd.chunk_bwd_dqkwg = counted


def lift_fla_guard() -> None:
    import fla.ops.common.chunk_o as chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="8192 (CUDA), 200 (CPU)")
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--dim", type=int, default=None, help="128 (CUDA), 16 (CPU)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no job after this many seconds")
    parser.add_argument("--jobs", nargs="+", default=list(DEFAULT_JOBS), help="KEY_HEADS:VALUE_HEADS/IMPL ...")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    args.tokens = args.tokens or (200 if cpu else 8192)
    args.dim = args.dim or (16 if cpu else 128)
    if cpu:  # the same jobs at a tiny shape
        args.jobs = [job.replace("32:32", "4:4").replace("16:32", "2:4") for job in args.jobs]
    return args


def parse_job(job: str) -> tuple[tuple[int, int], str]:
    shape, _, impl = job.partition("/")
    key_heads, _, value_heads = shape.partition(":")
    return (int(key_heads), int(value_heads)), impl


def make_inputs(args, heads: tuple[int, int], dtype: torch.dtype, seed: int = 0) -> dict:
    """Layer-like inputs: l2-normalised q, k of the key heads; g = -softplus(.) as the layer's decay; beta in (0, 1)."""
    key_heads, value_heads = heads
    gen = torch.Generator(device=args.device).manual_seed(seed)

    def randn(*s):
        return torch.randn(*s, generator=gen, device=args.device, dtype=torch.float32)

    q = gdr.l2norm(randn(1, args.tokens, key_heads, args.dim))
    k = gdr.l2norm(randn(1, args.tokens, key_heads, args.dim))
    v = randn(1, args.tokens, value_heads, args.dim)
    g = -F.softplus(randn(1, args.tokens, value_heads) - 2.0)
    beta = randn(1, args.tokens, value_heads).sigmoid()
    state = randn(args.seqs, value_heads, args.dim, args.dim) * 0.1
    bounds = torch.linspace(0, args.tokens, args.seqs + 1).round().long()
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta.to(dtype), initial_state=state,
                cu_seqlens=bounds.to(device=args.device, dtype=torch.int32))


def _no_refusal(*args, **kwargs) -> None:
    return None


def call(impl: str, inputs: dict, grad: bool = False):
    gdr.KERNEL_OVERRIDE = {UNGUARDED: "fla", UNCHECKED: "fla-dqkwg"}.get(impl, impl)
    checked = gdr.fla_dqkwg_refusal
    if impl == UNCHECKED:
        gdr.fla_dqkwg_refusal = _no_refusal
    try:
        return _call(inputs, grad)
    finally:
        gdr.fla_dqkwg_refusal = checked


def _call(inputs: dict, grad: bool):
    args = {k: (v.detach().requires_grad_() if grad and k != "cu_seqlens" else v) for k, v in inputs.items()}
    out, final = gdr.chunk_gated_delta_rule(args["q"], args["k"], args["v"], args["g"], args["beta"],
                                            initial_state=args["initial_state"], output_final_state=True,
                                            cu_seqlens=args["cu_seqlens"])
    if not grad:
        return out, final, None
    wide = torch.promote_types(out.dtype, torch.float32)
    gen = torch.Generator(device=out.device).manual_seed(7)
    noise = torch.randn(out.shape, generator=gen, device=out.device).to(wide)
    loss = (out.to(wide) * noise).sum() + final.sum()
    grads = torch.autograd.grad(loss, [args[n] for n in GRAD_NAMES])
    return out, final, dict(zip(GRAD_NAMES, grads))


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
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"


class Shape:
    """One head shape's inputs and fp64 references (built on first use)."""

    def __init__(self, args, heads: tuple[int, int], with_fp32: bool):
        self.heads, self.with_fp32 = heads, with_fp32
        self.label = f"{heads[0]}:{heads[1]}"
        self.fp32, self.bf16 = make_inputs(args, heads, torch.float32), make_inputs(args, heads, torch.bfloat16)
        t0 = time.perf_counter()
        with torch.no_grad():
            self.truth = gdr.recurrent_gated_delta_rule(
                *(self.fp32[n].double() for n in ("q", "k", "v", "g", "beta")),
                initial_state=self.fp32["initial_state"].double(), output_final_state=True,
                cu_seqlens=self.fp32["cu_seqlens"])
        recurrence_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        rounded = {n: (x.double() if x.is_floating_point() else x) for n, x in self.bf16.items()}
        out64, _, self.grads64 = call("torch", rounded, grad=True)
        with torch.no_grad():
            rounded_truth = gdr.recurrent_gated_delta_rule(
                *(rounded[n] for n in ("q", "k", "v", "g", "beta")), initial_state=rounded["initial_state"],
                output_final_state=True, cu_seqlens=rounded["cu_seqlens"])[0]
        print(f"shape {self.label} (key:value heads): fp64 recurrence {recurrence_s:.1f} s; fp64 gradients (chunked "
              f"rule) {time.perf_counter() - t0:.1f} s, its output {diff(out64, rounded_truth):.1e} from the "
              f"recurrence's", flush=True)


def measure(impl: str, shape: Shape, args) -> dict:
    row = {"impl": impl, "shape": shape.label}
    if impl == UNGUARDED:
        lift_fla_guard()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    calls_before = _project_dqkwg_calls[0]
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            call(impl, shape.bf16)
        sync()
    except Exception as err:  # noqa: BLE001 - a benchmark reports what an implementation refuses
        row["error"] = short(err)
        return row
    row["first_call_s"] = time.perf_counter() - t0
    if impl == "fla-dqkwg":
        b = shape.bf16
        row["check"] = gdr.fla_dqkwg_refusal(b["q"], b["k"], b["v"], b["g"], b["beta"]) or "passed"
    with torch.no_grad():
        row["fwd_ms"] = timed_ms(lambda: call(impl, shape.bf16), args.iters, args.device)
    for name, inputs in (("fp32", shape.fp32), ("bf16", shape.bf16)):
        if name == "fp32" and not shape.with_fp32:
            continue
        try:
            with torch.no_grad():
                out, final, _ = call(impl, inputs)
            row[f"{name}_out_err"], row[f"{name}_state_err"] = diff(out, shape.truth[0]), diff(final, shape.truth[1])
            row[f"{name}_out"], row[f"{name}_final"] = out, final
        except Exception as err:  # noqa: BLE001
            row[f"{name}_error"] = short(err)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        t0 = time.perf_counter()
        row["grads_bf16"] = call(impl, shape.bf16, grad=True)[2]
        sync()
        row["first_bwd_s"] = time.perf_counter() - t0
        row["fwd_bwd_ms"] = timed_ms(lambda: call(impl, shape.bf16, grad=True), args.iters, args.device)
        if args.device == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception as err:  # noqa: BLE001
        row["bwd_error"] = short(err)
    row["project_dqkwg_calls"] = _project_dqkwg_calls[0] - calls_before
    if impl == "compiled" and shape.with_fp32 and "bwd_error" not in row:  # a new packing: no recompile expected
        t = args.tokens
        other = dict(shape.bf16, cu_seqlens=torch.tensor([0, t // 82, 3 * t // 8, t - t // 12, t],
                                                         dtype=torch.int32, device=args.device))
        other["initial_state"] = shape.bf16["initial_state"][:1].expand(4, -1, -1, -1).contiguous()
        t0 = time.perf_counter()
        call(impl, other, grad=True)
        sync()
        row["new_packing_s"] = time.perf_counter() - t0
    return row


HEADER = (f"{'shape':6} {'impl':14} {'first s':>8} {'fwd ms':>8} {'fwd+bwd ms':>10} {'peak GiB':>8} "
          f"{'fp32 out err':>12} {'fp32 state':>10} {'bf16 out err':>12} {'bf16 state':>10}")


def print_row(r: dict) -> None:
    lead = f"ROW {r['shape']:6} {r['impl']:14}"
    if r.get("check", "passed") != "passed":
        lead += " REFUSED by its first-use check: these figures are the compiled rule's;"
    if "error" in r:
        print(f"{lead} FAILED {r['error']}", flush=True)
        return
    nan = float("nan")
    cells = [f"{r.get('first_call_s', nan):8.2f}", f"{r['fwd_ms']:8.2f}", f"{r.get('fwd_bwd_ms', nan):10.2f}",
             f"{r.get('peak_gib', nan):8.2f}"]
    cells += [f"{r.get(k, nan):12.2e}" if "out" in k else f"{r.get(k, nan):10.2e}"
              for k in ("fp32_out_err", "fp32_state_err", "bf16_out_err", "bf16_state_err")]
    print(f"{lead} " + " ".join(cells), flush=True)
    for key in ("fp32_error", "bf16_error", "bwd_error"):
        if key in r:
            print(f"    {key}: {r[key]}", flush=True)
    notes = []
    if "check" in r:
        notes.append(f"first-use check: {r['check']}")
    if "first_bwd_s" in r:
        notes.append(f"first fwd+bwd call {r['first_bwd_s']:.2f} s")
    if "new_packing_s" in r:
        notes.append(f"a new packing's first fwd+bwd {r['new_packing_s']:.2f} s")
    if r["impl"] == UNCHECKED:
        notes.append("the first-use check skipped (it refused fla-dqkwg above): a measurement only")
    if r["impl"].startswith("fla"):
        notes.append(f"calls of the project's chunk_bwd_dqkwg: {r.get('project_dqkwg_calls', 0)}")
    if notes:
        print("    " + "; ".join(notes), flush=True)


def grad_errors(r: dict, shape: Shape) -> dict[str, tuple[float, float]]:
    """Per gradient: (max abs difference from fp64, that over the largest fp64 gradient)."""
    out = {}
    for n in GRAD_NAMES:
        want = shape.grads64[n]
        err = diff(r["grads_bf16"][n], want)
        out[n] = (err, err / max(want.abs().max().item(), 1e-30))
    return out


def print_grads(r: dict, shape: Shape) -> None:
    if not r.get("grads_bf16"):
        return
    r["grad_errors"] = grad_errors(r, shape)
    cells = " ".join(f"{n} {a:.2e} ({rel:.1e})" for n, (a, rel) in r["grad_errors"].items())
    print(f"GRADS {r['shape']} {r['impl']}: max abs diff from fp64 (relative to the largest): {cells}", flush=True)


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


def summarize(rows: list[dict]) -> None:
    print("\nbetween implementations, per shape (max abs diff; gradients of the bf16 call, over the second's largest):")
    for label in dict.fromkeys(r["shape"] for r in rows):
        done = [r for r in rows if r["shape"] == label and "error" not in r]
        for i, a in enumerate(done):
            for b in done[i + 1:]:
                print(f"  {label} {a['impl']} vs {b['impl']}: {compare(a, b)}")
        by = {r["impl"]: r for r in done}
        new, old = by.get("fla-dqkwg", {}), by.get("compiled", {})
        if new.get("check", "passed") != "passed":
            print(f"REFUSED {label}: fla-dqkwg's first-use check: {new['check']}")
            new = by.get(UNCHECKED, {})  # the same kernels with the check skipped
        if "fwd_bwd_ms" in new and "fwd_bwd_ms" in old:
            print(f"RATIO {label} fwd+bwd compiled / {new['impl']} = {old['fwd_bwd_ms']:.2f} / {new['fwd_bwd_ms']:.2f} ms "
                  f"= {old['fwd_bwd_ms'] / new['fwd_bwd_ms']:.1f}x (target >= 5x); fwd {old['fwd_ms']:.2f} / "
                  f"{new['fwd_ms']:.2f} ms = {old['fwd_ms'] / new['fwd_ms']:.1f}x")
        if "grad_errors" in new and "grad_errors" in old:
            worse = [n for n in GRAD_NAMES if new["grad_errors"][n][0] > old["grad_errors"][n][0]]
            print(f"ERRORS {label} {new['impl']} vs compiled, bf16 out {new.get('bf16_out_err', float('nan')):.2e} vs "
                  f"{old.get('bf16_out_err', float('nan')):.2e}, state {new.get('bf16_state_err', float('nan')):.2e} "
                  f"vs {old.get('bf16_state_err', float('nan')):.2e}; gradients: " + " ".join(
                      f"{n} {new['grad_errors'][n][0]:.1e} vs {old['grad_errors'][n][0]:.1e}" for n in GRAD_NAMES)
                  + f"; larger for {new['impl']}: {', '.join(worse) or 'none'}")


def conv_check(args) -> None:
    """The packed causal conv on the device: agreement with the CPU and its cost against one plain conv1d."""
    channels = 2 * 16 * args.dim + 32 * args.dim  # q, k (16 key heads) and v (32 value heads): Qwen3.5-4B's conv
    gen = torch.Generator(device=args.device).manual_seed(3)
    x = torch.randn(1, args.tokens, channels, generator=gen, device=args.device, dtype=torch.bfloat16)
    weight = torch.randn(channels, 4, generator=gen, device=args.device, dtype=torch.bfloat16)
    cu = torch.linspace(0, args.tokens, args.seqs + 1).round().long().to(args.device)
    out = gdr.causal_conv1d(x.float(), weight.float(), cu_seqlens=cu)
    cpu = gdr.causal_conv1d(x.cpu().float(), weight.cpu().float(), cu_seqlens=cu.cpu())
    x.requires_grad_()

    def packed():
        gdr.causal_conv1d(x, weight, cu_seqlens=cu).sum().backward()

    def plain():
        gdr.causal_conv1d(x, weight).sum().backward()

    print(f"causal_conv1d [1, {args.tokens}, {channels}] K=4: fp32 max abs diff from the CPU "
          f"{diff(out, cpu.to(out.device)):.2e}; bf16 fwd+bwd packed {timed_ms(packed, args.iters, args.device):.3f} "
          f"ms, unpacked {timed_ms(plain, args.iters, args.device):.3f} ms", flush=True)


def environment(args) -> None:
    logging.basicConfig(level=logging.WARNING, format="LOG %(name)s: %(message)s", stream=sys.stdout)
    for name in (gdr.__name__, "fla.backends"):  # the kernel choice, the first-use check, fla's backend routing
        logging.getLogger(name).setLevel(logging.INFO)
    if args.device == "cuda":
        import triton

        print(f"device {torch.cuda.get_device_name()} capability {torch.cuda.get_device_capability()} "
              f"torch {torch.__version__} triton {triton.__version__}", flush=True)
    try:
        import fla

        print(f"fla {getattr(fla, '__version__', '?')} from {os.path.dirname(fla.__file__)}", flush=True)
    except ImportError as err:
        print(f"fla: not importable ({err})", flush=True)
    gdr.KERNEL_OVERRIDE = None
    try:
        print(f"auto choice: {gdr.active_kernel(torch.device(args.device))}", flush=True)
    except Exception as err:  # noqa: BLE001
        print(f"auto choice: {short(err)}", flush=True)


def run(args) -> None:
    start = time.perf_counter()
    environment(args)
    count_project_dqkwg()
    print(f"B=1, T={args.tokens} as {args.seqs} sequences, Dk=Dv={args.dim}; jobs: {' '.join(args.jobs)}", flush=True)
    try:
        conv_check(args)
    except Exception as err:  # noqa: BLE001
        print(f"causal_conv1d check FAILED: {short(err)}", flush=True)
    shapes: dict[tuple[int, int], Shape] = {}
    rows = []
    print(HEADER, flush=True)
    jobs = list(args.jobs)
    for position, job in enumerate(jobs):  # a refused fla-dqkwg adds its unchecked job after it
        heads, impl = parse_job(job)
        if time.perf_counter() - start > args.budget_s:
            print(f"ROW {heads[0]}:{heads[1]} {impl:14} SKIPPED: {args.budget_s:g} s budget spent", flush=True)
            continue
        try:
            if heads not in shapes:
                shapes[heads] = Shape(args, heads, with_fp32=not shapes)
            row = measure(impl, shapes[heads], args)
        except Exception as err:  # noqa: BLE001 - one job's failure never hides the others
            row = {"impl": impl, "shape": f"{heads[0]}:{heads[1]}", "error": short(err)}
            traceback.print_exc(limit=3, file=sys.stdout)
        print_row(row)
        if heads in shapes:
            print_grads(row, shapes[heads])
        rows.append(row)
        if impl == "fla-dqkwg" and row.get("check", "passed") != "passed":
            jobs.insert(position + 1, f"{heads[0]}:{heads[1]}/{UNCHECKED}")
        gdr.KERNEL_OVERRIDE = None
        if args.device == "cuda":
            torch.cuda.empty_cache()
    summarize(rows)
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        run(args)
    except Exception:  # noqa: BLE001 - print what broke; the rows printed so far stand
        traceback.print_exc(file=sys.stdout)
        print("FAILED: the benchmark stopped early (above)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
