"""The fenced training step under torchrun, without Ray or engines: NCCL on GPUs, gloo on CPU.

    torchrun --nproc-per-node N benchmarks/gpu_fenced_step.py [train.py flags...] \
        --cycles 20 --bench-fence-overhead [--bench-weight-sync] [--model-size 0.5b]

Each rank builds `args` with slime.utils.arguments.parse_args (the flags of train.py), runs
MegatronTrainActor directly (rank/world/master from torchrun's env), and per cycle does what a
colocated run does: sleep() -> train(cycle, data) (train wakes first: with
--recreate-process-groups-on-wake the groups are destroyed at sleep and re-created, fenced and
warmed at wake). The rollout batch is synthetic, from a fixed seed, and replayed every cycle.

Fence overhead (--bench-fence-overhead): the ledger times every fence; per cycle we sum the
fences inside train() and divide by train()'s wall time (same run, medians over cycles after
the first). A micro-benchmark of back-to-back fences gives the latency of one fence.
With --ab-fences, cycles after the first rotate through "on" (fenced, recorded) and each variant
of --ab-off: fences (fence calls are no-ops), ledger (collectives not recorded), both, none (an A/A
control that switches nothing off). The order rotates by one every block, so a drift or a
period-two effect does not favour a variant; the summary holds each variant's median cycle time
against "on" with a bootstrap 90 % interval, and where in the step the difference sits.
Each cycle runs under a frame named cycle_<variant> (cycle_warmup for cycle 0), so a sampling
profiler's stacks split by variant (benchmarks/profile_split.py).

Weight-sync cost (--bench-weight-sync): export_hf_weights (TP gather + HF conversion) grouped
into the sync's bucket plan, then the embedded engine's payload (a shared-memory file) per bucket,
on the ranks that do it in a real sync; seconds and GB/s.

Rank 0 prints one JSON line per cycle ("CYCLE {...}") and a summary ("SUMMARY {...}"), and
writes them to --results-json. A rank that fails prints "FAILED rank=R after=S: Error: msg".
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor. is deprecated")

import torch  # noqa: E402

MODEL_SIZES = {
    # ~0.6B parameters (vocab 151936 untied dominates a third of them).
    "0.5b": dict(layers=24, hidden=1024, heads=16, kv_heads=8, head_dim=64, ffn_hidden=3072),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=128),
}


@dataclass(frozen=True, kw_only=True)
class DriverOptions:
    """Flags of this driver; every other flag goes to slime's parse_args unchanged."""

    cycles: int
    bench_fence_overhead: bool
    bench_weight_sync: bool
    ab_fences: bool
    ab_off: tuple[str, ...]
    model_size: str
    checkpoint_dir: str
    num_samples: int
    min_tokens: int
    max_tokens: int
    data_seed: int
    fp32: bool
    results_json: str | None
    fence_repeats: int
    check_wake_exact: bool


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def read(cls) -> "TorchrunEnv":
        env = os.environ
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])),
                   env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")))


def parse_driver(argv: list[str]) -> tuple[DriverOptions, list[str]]:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--bench-fence-overhead", action="store_true")
    p.add_argument("--bench-weight-sync", action="store_true")
    p.add_argument("--ab-fences", action="store_true", help="rotate 'on' and the --ab-off variants over cycles")
    p.add_argument("--ab-off", nargs="+", choices=AB_VARIANTS, default=["both"],
                   help="variants to compare with 'on': what a cycle switches off (fences, the ledger's "
                        "collective recording, both, or none: A/A control)")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny")
    p.add_argument("--checkpoint-dir", default=None, help="where the random HF checkpoint is written (once)")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--fp32", action="store_true", help="keep fp32 on GPU (default there: --bf16)")
    p.add_argument("--results-json", default=None)
    p.add_argument("--fence-repeats", type=int, default=50)
    p.add_argument("--check-wake-exact", action="store_true",
                   help="after cycle 0: sleep, wake, and compare parameters and optimizer state element-wise")
    ns, rest = p.parse_known_args(argv)
    if ns.ab_fences and ns.cycles < 1 + 2 * (1 + len(ns.ab_off)):
        p.error("--ab-fences needs cycle 0 (warm-up) and at least two blocks of 'on' + each --ab-off variant")
    ckpt = ns.checkpoint_dir or os.path.join(tempfile.gettempdir(), f"gpu_fenced_step_{ns.model_size}")
    return DriverOptions(
        cycles=ns.cycles, bench_fence_overhead=ns.bench_fence_overhead, bench_weight_sync=ns.bench_weight_sync,
        ab_fences=ns.ab_fences, ab_off=tuple(dict.fromkeys(ns.ab_off)),
        model_size=ns.model_size, checkpoint_dir=ckpt, num_samples=ns.num_samples, min_tokens=ns.min_tokens,
        max_tokens=ns.max_tokens, data_seed=ns.data_seed, fp32=ns.fp32, results_json=ns.results_json,
        fence_repeats=ns.fence_repeats, check_wake_exact=ns.check_wake_exact,
    ), rest


# ------------------------------------------------------------------------------ checkpoint
def write_random_checkpoint(out_dir: str, model_size: str, seed: int = 1234) -> str:
    """Qwen3 config + random safetensors, written tensor by tensor (no model init: fast at 0.5B).

    Values come from a seeded CPU generator, so CPU and GPU runs load the same weights; the
    returned checksum lets a reader confirm that.
    """
    from safetensors.torch import save_file
    from transformers import Qwen3ForCausalLM

    from slime.tools.tiny_checkpoint import TinyQwen3Spec, build_config

    config = build_config(TinyQwen3Spec(**MODEL_SIZES[model_size], seed=seed))
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Qwen3ForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.05 * torch.randn(shapes[name], generator=gen)
        else:
            tensors[name] = 0.02 * torch.randn(shapes[name], generator=gen)
    tmp = Path(tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(out_dir)) or ".", prefix=".ckpt_"))
    save_file(tensors, str(tmp / "model.safetensors"))
    config.save_pretrained(str(tmp))
    checksum = float(sum(t.double().abs().sum() for t in tensors.values()))
    (tmp / "checksum.json").write_text(json.dumps({"abs_sum": checksum, "model_size": model_size, "seed": seed}))
    os.replace(tmp, out_dir)  # atomic: readers see a complete directory or none
    return out_dir


def ensure_checkpoint(opts: DriverOptions, env: TorchrunEnv, deadline_s: float = 900.0) -> str:
    """Local rank 0 writes the checkpoint once; the others wait for it (bounded)."""
    path = opts.checkpoint_dir
    if env.local_rank == 0 and not os.path.exists(os.path.join(path, "checksum.json")):
        write_random_checkpoint(path, opts.model_size)
    end = time.monotonic() + deadline_s
    while not os.path.exists(os.path.join(path, "checksum.json")):
        if time.monotonic() > end:
            raise TimeoutError(f"checkpoint {path} not written within {deadline_s:g}s")
        time.sleep(0.2)
    return path


# ------------------------------------------------------------------------------ data
def synthetic_rollout(opts: DriverOptions, vocab_size: int, n_samples_per_prompt: int) -> dict:
    """Random tokens, prompt/response split, loss masks and GRPO-normalised rewards, from a fixed seed."""
    rng = random.Random(opts.data_seed)
    data = {k: [] for k in ("tokens", "response_lengths", "loss_masks", "rewards", "raw_reward",
                            "truncated", "sample_indices")}
    raw = [float(rng.random() < 0.5) for _ in range(opts.num_samples)]
    for i in range(opts.num_samples):
        total = rng.randint(opts.min_tokens, opts.max_tokens)
        response = rng.randint(max(1, total // 4), total - 1)
        data["tokens"].append([rng.randrange(vocab_size) for _ in range(total)])
        data["response_lengths"].append(response)
        mask = [1] * response
        for j in rng.sample(range(response), k=min(3, response - 1)):
            mask[j] = 0
        data["loss_masks"].append(mask)
        data["raw_reward"].append(raw[i])
        data["truncated"].append(0)
        data["sample_indices"].append(i)
    for start in range(0, opts.num_samples, n_samples_per_prompt):
        group = raw[start:start + n_samples_per_prompt]
        mean = sum(group) / len(group)
        data["rewards"] += [r - mean for r in group]
    return data


# ------------------------------------------------------------------------------ args
def train_argv(opts: DriverOptions, env: TorchrunEnv, rest: list[str], ckpt: str) -> list[str]:
    """Defaults a bare run needs, then the user's flags (they win), then what torchrun fixes."""
    n_per_prompt = 8 if opts.num_samples % 8 == 0 else 1
    defaults = ["--num-rollout", str(opts.cycles), "--rollout-batch-size", str(opts.num_samples // n_per_prompt),
                "--n-samples-per-prompt", str(n_per_prompt), "--seed", "1234", "--lr", "1e-6",
                "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
                "--rollout-backend", "embedded"]  # no engines run here; the weight-sync bench encodes for this kind
    if torch.cuda.is_available() and not opts.fp32:
        defaults.append("--bf16")
    return defaults + rest + ["--hf-checkpoint", ckpt, "--actor-num-nodes", "1",
                              "--actor-num-gpus-per-node", str(env.world_size)]


# ------------------------------------------------------------------------------ measurements
def fence_seconds(entries) -> dict[str, float]:
    """Summed durations of fence ops among ledger entries, split into wake fences and the rest."""
    out = {"wake": 0.0, "step": 0.0}
    for e in entries:
        if e.op.startswith("fence:") and e.end is not None:
            out["wake" if e.op.startswith("fence:wake/") else "step"] += e.end - e.start
    return out


class _NoFence:
    """The fence of an unfenced A/B cycle: agrees with itself, talks to no one (benchmark only)."""

    def __call__(self, phase: str, fields=None, *, timeout_s=None) -> None:
        return None


AB_VARIANTS = ("fences", "ledger", "both", "none")


def ab_schedule(cycles: int, offs: tuple[str, ...]) -> list[str]:
    """Variant of each cycle: 'on' for the warm-up cycle 0, then blocks holding every variant once,
    the order rotated by one per block (two variants: on, off, off, on, on, off, ...)."""
    variants = ("on",) + offs
    return ["on"] + [variants[(pos + block) % len(variants)]
                     for block, pos in (divmod(i, len(variants)) for i in range(cycles - 1))]


@contextlib.contextmanager
def switched_off(actor, off: str):
    """One cycle without fences and/or without the ledger's collective recording ('none': as 'on')."""
    from slime.distributed import instrument_collectives, uninstrument_collectives

    fence = actor.groups._fence
    if off in ("both", "fences"):
        actor.groups._fence = _NoFence()
    if off in ("both", "ledger"):
        uninstrument_collectives()
    try:
        yield
    finally:
        actor.groups._fence = fence
        instrument_collectives(actor.ledger)  # idempotent when recording stayed on


class PhaseClock:
    """Wall seconds per watchdog phase of one cycle, so that an A/B difference can be placed in the step."""

    def __init__(self, watchdog):
        self.seconds: dict[str, float] = {}
        inner = watchdog.phase

        @contextlib.contextmanager
        def timed(name: str, deadline_s: float | None = None):
            start = time.perf_counter()
            try:
                with inner(name, deadline_s):
                    yield
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        watchdog.phase = timed

    def take(self) -> dict[str, float]:
        seconds, self.seconds = self.seconds, {}
        return seconds


def cycle_frame(variant: str):
    """run_cycle under a function named `cycle_<variant>`, so that a sampling profiler's stacks
    (py-spy, benchmarks/profile_split.py) tell the A/B variants apart within one run."""
    def cycle(actor, cycle: int, data: dict) -> dict:
        return run_cycle(actor, cycle, data)
    name = f"cycle_{variant}"
    cycle.__code__ = cycle.__code__.replace(co_name=name, co_qualname=name)
    return cycle


def run_cycle(actor, cycle: int, data: dict) -> dict:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    gc.collect()  # collect between cycles, never inside one: a gen-2 pass is cycle-to-cycle noise
    gc.disable()
    try:
        return _timed_cycle(actor, cycle, data, sync)
    finally:
        gc.enable()


def _timed_cycle(actor, cycle: int, data: dict, sync) -> dict:
    start = time.perf_counter()
    memory = actor.sleep()
    sleep_s = time.perf_counter() - start
    mark = actor.ledger.mark()
    metrics = actor.train(cycle, copy.deepcopy(data))
    sync()
    entries = actor.ledger.entries(since=mark)
    fences = fence_seconds(entries)
    train_s = metrics["perf/actor_train_s"]
    wake_s = metrics.get("perf/wake_create_groups_s", 0.0) + metrics.get("perf/wake_warmup_s", 0.0)
    return {
        "cycle": cycle,
        "loss": metrics["train/loss"],
        "grad_norm": metrics["train/grad_norm"],
        "num_micro_batches": metrics["train/num_micro_batches"],
        "loss_tokens": metrics["train/loss_tokens"],
        "sleep_s": sleep_s,
        "train_s": train_s,
        "wake_create_groups_s": metrics.get("perf/wake_create_groups_s", 0.0),
        "wake_warmup_s": metrics.get("perf/wake_warmup_s", 0.0),
        "collectives": sum(1 for e in entries if not e.op.startswith("fence:")),  # recorded ones (0: recording off)
        "wake_fence_s": fences["wake"],
        "step_fence_s": fences["step"],
        # fences of the step proper (plan + exit) over the step without the wake phase
        "step_fence_ratio": fences["step"] / max(train_s - wake_s - fences["wake"], 1e-9),
        "all_fence_ratio": (fences["step"] + fences["wake"]) / train_s,
        "memory": memory,
    }


def check_sleep_wake_exact(actor) -> dict:
    """Parameters and optimizer state before a sleep equal them after the wake, element for element
    (the CPU tests check the same on gloo; this is the CUDA allocator's and pinned copies' turn)."""
    from slime.backends.megatron_utils.offload import torch_optimizers

    state = [p for chunk in actor.model for p in chunk.parameters()]
    for inner in torch_optimizers(actor.optimizer):
        state += [p for group in inner.param_groups for p in group["params"]]
        state += [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    before = [t.detach().to("cpu", copy=True) for t in state]
    report = actor.sleep()
    device = state[0].device  # the training device; Adam's step counters stay on the host by design
    freed = all(t.untyped_storage().nbytes() == 0 for t in state if t.device == device)
    actor.wake(-1)
    exact = all(torch.equal(b, t.detach().cpu()) for b, t in zip(before, state))
    return {"wake_bit_exact": exact, "sleep_freed_every_state_storage": freed, "state_tensors": len(state),
            "check_sleep": report}


def bench_fence_latency(actor, repeats: int) -> dict[str, float]:
    """Median seconds of one clean fence (same payload shape as the plan fence)."""
    fields = {"rollout_id": -1, "plan_hash": "x" * 16, "num_micro_batches": [[1]]}
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        actor.groups.fence(f"bench/fence{i}", fields)
        times.append(time.perf_counter() - start)
    return {"fence_median_s": statistics.median(times), "fence_p90_s": sorted(times)[int(0.9 * (len(times) - 1))]}


def bench_weight_sync(actor, repeats: int = 3) -> dict[str, float]:
    """Trainer-side cost of a weight sync: export (TP gather + HF conversion) and per-bucket encode."""
    from slime.backends.weight_sync.plan import build_weight_sync_plan, iter_planned_buckets
    from slime.backends.weight_sync.sync import SyncRole
    from slime.backends.sglang_utils.shared_payload import make_run_directory, write_shared_bucket
    from slime.utils.security import ApiKey
    from slime_plugins.models.hf_weights import export_hf_weights

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    role = SyncRole.current()
    plan = build_weight_sync_plan(actor.model, actor.hf_config, tp_size=role.tp_size,
                                  bucket_bytes=actor.weight_sync.bucket_bytes, pp_rank=role.pp_rank)
    runs = []
    shared_dir = make_run_directory(ApiKey.generate())  # private, as a run's
    for _ in range(repeats):
        actor.groups.fence("bench/weight_sync_start")
        gather_s = encode_s = 0.0
        if role.exporter:  # the ranks that iterate the export in a real sync
            stream = iter_planned_buckets(plan, export_hf_weights(list(actor.model), actor.hf_config))
            while True:
                t0 = time.perf_counter()
                item = next(stream, None)
                sync()
                gather_s += time.perf_counter() - t0
                if item is None:
                    break
                if role.sender:
                    t0 = time.perf_counter()
                    write_shared_bucket(item[1], shared_dir, f"bench-bucket{item[0].index}").remove()
                    encode_s += time.perf_counter() - t0
        runs.append((gather_s, encode_s))
    actor.groups.fence("bench/weight_sync_done")
    shared_dir.rmdir()
    gather = statistics.median(r[0] for r in runs)
    encode = statistics.median(r[1] for r in runs)
    gb = plan.total_bytes / 1e9
    return {"ws_total_gb": gb, "ws_buckets": len(plan.buckets), "ws_export_s": gather, "ws_encode_s": encode,
            "ws_export_gbps": gb / gather if gather else 0.0, "ws_encode_gbps": gb / encode if encode else 0.0,
            "ws_total_s": gather + encode, "ws_tp": role.tp_size, "ws_sender": role.sender}


def ab_summary(cycles: list[dict]) -> dict[str, dict]:
    """Per variant: median cycle time (sleep + train) of 'on' over the variant's, cycles after the first."""
    times: dict[str, list[float]] = {}
    for c in cycles[1:]:
        times.setdefault(c["variant"], []).append(c["sleep_s"] + c["train_s"])
    on = times["on"]
    return {f"ab_{variant}": {"cycles": len(t), "on_median_s": statistics.median(on),
                              "off_median_s": statistics.median(t),
                              "ratio": statistics.median(on) / statistics.median(t),
                              "ratio_90": bootstrap_ratio_interval(on, t),
                              "phase_delta_ms": ab_phase_deltas(cycles[1:], variant)}
            for variant, t in times.items() if variant != "on"}


def bootstrap_ratio_interval(on: list[float], off: list[float], reps: int = 2000) -> tuple[float, float]:
    """5th and 95th percentile of median(on) / median(off) over resampled cycles: what the ratio can resolve."""
    rng = random.Random(0)
    ratios = sorted(statistics.median(rng.choices(on, k=len(on))) / statistics.median(rng.choices(off, k=len(off)))
                    for _ in range(reps))
    return round(ratios[reps // 20], 4), round(ratios[reps - 1 - reps // 20], 4)


def ab_phase_deltas(cycles: list[dict], variant: str) -> dict[str, float]:
    """Median 'on' minus median `variant` milliseconds per phase: where the difference sits."""
    names = sorted({name for c in cycles for name in c["phase_s"]})
    def med(name: str, which: str) -> float:
        return statistics.median(c["phase_s"].get(name, 0.0) for c in cycles if c["variant"] == which)
    return {name: round(1e3 * (med(name, "on") - med(name, variant)), 2) for name in names}


def summarize(cycles: list[dict]) -> dict[str, float]:
    steady = [c for c in cycles[1:] if c["variant"] == "on"] or cycles
    med = lambda key: statistics.median(c[key] for c in steady)  # noqa: E731
    return {
        "cycles": len(cycles),
        "median_train_s": med("train_s"),
        "median_wake_create_groups_s": med("wake_create_groups_s"),
        "median_wake_warmup_s": med("wake_warmup_s"),
        "median_step_fence_s": med("step_fence_s"),
        "median_wake_fence_s": med("wake_fence_s"),
        "median_step_fence_ratio": med("step_fence_ratio"),
        "median_all_fence_ratio": med("all_fence_ratio"),
        "first_loss": cycles[0]["loss"],
        "first_grad_norm": cycles[0]["grad_norm"],
    }


# ------------------------------------------------------------------------------ main


def build_actor(args, env: TorchrunEnv):
    from slime.backends.megatron_utils.actor import MegatronTrainActor

    ledger_dir = args.ledger_dir or os.path.join(tempfile.gettempdir(), f"gpu_fenced_step_ledger_{env.master_port}")
    actor = MegatronTrainActor(args, env.rank, env.world_size, ledger_dir)
    # Under torchrun (TORCHELASTIC_USE_AGENT_STORE) every rank joins the agent's store on MASTER_PORT.
    actor.init(env.master_addr, env.master_port, engine_urls=[])
    return actor


def run(argv: list[str]) -> dict:
    from slime.utils.arguments import parse_args

    env = TorchrunEnv.read()
    opts, rest = parse_driver(argv)
    ckpt = ensure_checkpoint(opts, env)
    args = parse_args(train_argv(opts, env, rest, ckpt))
    actor = build_actor(args, env)
    data = synthetic_rollout(opts, actor.hf_config.vocab_size, args.n_samples_per_prompt)
    layout = {"world": env.world_size, "tp": args.tensor_model_parallel_size, "cp": args.context_parallel_size,
              "sp": args.sequence_parallel, "dp": args.data_parallel_size, "bf16": args.bf16,
              "recreate_groups": args.recreate_process_groups_on_wake, "model_size": opts.model_size,
              "checkpoint_abs_sum": json.loads(Path(ckpt, "checksum.json").read_text())["abs_sum"],
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "samples": opts.num_samples,
              "data_tokens": sum(len(t) for t in data["tokens"])}
    clock = PhaseClock(actor.watchdog)
    schedule = ab_schedule(opts.cycles, opts.ab_off) if opts.ab_fences else ["on"] * opts.cycles
    cycles, exactness = [], {}
    for cycle, variant in enumerate(schedule):  # same schedule on every rank: a function of the flags
        with switched_off(actor, variant) if variant != "on" else contextlib.nullcontext():
            result = {**cycle_frame(variant if cycle else "warmup")(actor, cycle, data), "variant": variant}
        result["phase_s"] = clock.take()
        cycles.append(result)
        if env.rank == 0:
            print("CYCLE " + json.dumps(result), flush=True)
        if cycle == 0 and opts.check_wake_exact:  # after one step: the optimizer has state to keep
            exactness = check_sleep_wake_exact(actor)
            if env.rank == 0:
                print("WAKE_EXACT " + json.dumps(exactness), flush=True)
    summary = {**layout, **summarize(cycles), **exactness}
    if opts.ab_fences:
        summary.update(ab_summary(cycles))
    if opts.bench_fence_overhead:
        summary.update(bench_fence_latency(actor, opts.fence_repeats))
    if opts.bench_weight_sync:
        summary.update(bench_weight_sync(actor))
    if env.rank == 0:
        print("SUMMARY " + json.dumps(summary), flush=True)
        if opts.results_json:
            Path(opts.results_json).write_text(json.dumps({"options": asdict(opts), "summary": summary,
                                                           "cycles": cycles}, indent=2))
    return summary


def main() -> None:
    start = time.perf_counter()
    rank = os.environ.get("RANK", "?")
    try:
        run(sys.argv[1:])
    except BaseException as exc:  # noqa: BLE001 - report any ending, then leave without a teardown that could hang
        elapsed = time.perf_counter() - start
        first_line = (str(exc).strip().splitlines() or [""])[0]
        sys.stderr.write(traceback.format_exc())
        print(f"FAILED rank={rank} after={elapsed:.1f}s: {type(exc).__name__}: {first_line[:400]}", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown: every rank reached the last fence already


if __name__ == "__main__":
    main()
