"""Fence overhead: a fenced vs an unfenced pseudo-step, medians and their ratio.

    torchrun --nproc-per-node 8 benchmarks/bench_fence_overhead.py --tp 2 --cp 4      # NCCL on GPUs
    python benchmarks/bench_fence_overhead.py --world-size 8 --tp 2 --cp 4            # gloo on CPU (spawns ranks)

The pseudo-step does what a training step does to the communicators, without a model: per
micro-batch a TP all_reduce, a CP all-gather and a matmul, then a DP x CP gradient all_reduce.
The fenced variant adds what the fenced actor_train adds: a ledger recording every collective,
the plan fence (fingerprint of the plan), the exit fence (metric keys) and the step-end fence,
each phase under a watchdog deadline. Rank 0 prints the medians and the fenced/unfenced ratio,
and the median latency of one fence. The pseudo-step is much shorter than a real step, so the
ratio here is an upper bound; scale --hidden/--micro-batches towards the real step time.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8, help="CPU mode only: ranks to spawn")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256, help="matmul and tensor size per micro-batch")
    parser.add_argument("--fence-timeout", type=float, default=120.0)
    return parser.parse_args(argv)


def _device() -> torch.device:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def pseudo_step(cfg, device, fenced: bool, lifecycle, watchdog, step: int) -> None:
    from megatron.core import parallel_state as mpu

    from slime.distributed import plan_fingerprint

    phase = watchdog.phase if fenced else _no_phase
    tokens = [cfg.hidden] * cfg.micro_batches
    if fenced:
        with phase("actor_train/plan"):
            fp = plan_fingerprint(("plan", step), rollout_id=step, step_id=0, micro_batch_tokens=tokens,
                                  loss_token_total=sum(tokens), metric_keys=("loss", "grad_norm"))
            lifecycle.fence("actor_train/plan", fp.as_fields())
    weight = torch.randn(cfg.hidden, cfg.hidden, device=device)
    grad = torch.zeros(cfg.hidden, cfg.hidden, device=device)
    cp_size = mpu.get_context_parallel_world_size()
    with phase("actor_train/forward_backward"):
        for _ in range(cfg.micro_batches):
            act = torch.randn(cfg.hidden, cfg.hidden, device=device) @ weight
            dist.all_reduce(act, group=mpu.get_tensor_model_parallel_group())
            gathered = torch.empty(cp_size * act.numel(), device=device)
            dist.all_gather_into_tensor(gathered, act.flatten(), group=mpu.get_context_parallel_group())
            grad += act
        dist.all_reduce(grad, group=mpu.get_data_parallel_group(with_context_parallel=True))
    metrics = torch.ones(2, device=device)
    with phase("actor_train/exit"):
        if fenced:
            lifecycle.fence("actor_train/exit", {"metric_keys": ["grad_norm", "loss"]})
        dist.all_reduce(metrics, group=mpu.get_data_parallel_group(with_context_parallel=True))
    if fenced:
        lifecycle.fence("actor_train/step_end", {"step": step})
    _sync(device)


class _no_phase:
    def __init__(self, name: str):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_rank(rank: int, world_size: int, cfg: argparse.Namespace, ledger_dir: str) -> None:
    from slime.config import defaults_namespace
    from slime.config.run_config import run_groups
    from slime.distributed import Ledger, ProcessGroupLifecycle, Watchdog, instrument_collectives, uninstrument_collectives

    args = defaults_namespace(tensor_model_parallel_size=cfg.tp, context_parallel_size=cfg.cp,
                              pipeline_model_parallel_size=1, fence_timeout=cfg.fence_timeout,
                              recreate_process_groups_on_wake=False)
    ledger = Ledger(rank, world_size, ledger_dir)
    lifecycle = ProcessGroupLifecycle(run_groups(args, world_size), ledger=ledger)
    watchdog = Watchdog(cfg.fence_timeout, ledger_dir, rank, world_size, ledger=ledger)
    report = lifecycle.create(rollout_id=0)
    device = _device()
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(2 * cfg.steps + 2):
        fenced = step % 2 == 1  # interleave, so drift in machine load hits both alike
        if fenced:
            instrument_collectives(ledger)
        else:
            uninstrument_collectives()
        lifecycle.fence("bench/align") if step % 2 == 0 else None  # same starting line for both variants
        _sync(device)
        start = time.perf_counter()
        pseudo_step(cfg, device, fenced, lifecycle, watchdog, step)
        if step >= 2:  # skip one warm step of each
            times[fenced].append(time.perf_counter() - start)
    uninstrument_collectives()
    fence_s = []
    for i in range(cfg.steps):  # back-to-back fences: the latency of one
        start = time.perf_counter()
        lifecycle.fence("bench/latency", {"i": i, "metric_keys": ["grad_norm", "loss"]})
        fence_s.append(time.perf_counter() - start)
    ledger.close()
    watchdog.close()
    if rank == 0:
        print(f"fence latency: median={statistics.median(fence_s) * 1e3:.3f}ms over {cfg.steps} fences", flush=True)
        plain, fenced = statistics.median(times[False]), statistics.median(times[True])
        print(
            f"fence overhead: backend={dist.get_backend()} world={world_size} tp={cfg.tp} cp={cfg.cp} "
            f"steps={cfg.steps} unfenced_median={plain * 1e3:.2f}ms fenced_median={fenced * 1e3:.2f}ms "
            f"ratio={fenced / plain:.4f} overhead={100 * (fenced / plain - 1):+.2f}% warmup={report.seconds * 1e3:.1f}ms",
            flush=True,
        )


def _spawned(rank: int, world_size: int, port: int, cfg: argparse.Namespace, ledger_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=cfg.fence_timeout))
    run_rank(rank, world_size, cfg, ledger_dir)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    ledger_dir = tempfile.mkdtemp(prefix="bench_fence_")
    if "RANK" in os.environ:  # torchrun: NCCL when GPUs are present
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.fence_timeout), **kwargs)
        run_rank(rank, world_size, cfg, ledger_dir)
        dist.destroy_process_group()
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_spawned, args=(cfg.world_size, port, cfg, ledger_dir), nprocs=cfg.world_size, start_method="spawn")


if __name__ == "__main__":
    sys.exit(main())
