"""A run killed with SIGKILL (driver and every process of it) and resumed with --load continues exactly:
the same per-rollout metrics and bit-identical final weights and optimizer state as one uninterrupted
run of the same length.

One uninterrupted run of 4 rollouts (2 ranks, DP 2, two embedded engines behind the project's router,
a checkpoint after every rollout, the reference refreshed every 2 rollouts, shuffled prompts) is shared
by four kill points, each injected deterministically (slime/distributed/fault_inject.py, RUN_KILL_KINDS):
while rollout 3 generates, in rollout 3's actor_train, in rollout 2's weight sync, and in rollout 3's
checkpoint save after the shards were written. Every resume starts from checkpoint 2, whose reference
model (refreshed after rollout 1) differs from both --ref-load's weights and the actor's.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hook_plugins

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = str(Path(hook_plugins.__file__).resolve())
NUM_ROLLOUT = 4
RUN_TIMEOUT_S = 600  # one run: 5 to 7 minutes were seen on 2 cores shared with other jobs
# per-rollout metrics that must agree exactly: they depend only on the tokens, the weights and the optimizer
EXACT_KEYS = {"train": ("train/loss", "train/grad_norm", "train/kl_loss", "train/pg_loss"),
              "rollout": ("rollout/raw_reward", "rollout/response_len/mean")}
# the engines' log-probs come from batches of whatever requests were in flight: equal up to fp32 rounding
CLOSE_KEYS = {"train": ("train/train_rollout_logprob_abs_diff",)}

KILL_POINTS = {  # kind@rank#rollout -> (the rollout the resumed run starts at)
    "kill_during_rollout@0#3": 3,
    "kill_during_train@0#3": 3,
    "kill_during_weight_sync@0#2": 3,
    "kill_during_save@1#3": 3,
}


def test_a_run_kill_outside_a_run_of_its_own_refuses(monkeypatch):
    """The fault kills the whole session: never one that is not the run's (a shell's, pytest's)."""
    from slime.distributed import fault_inject

    monkeypatch.setenv(fault_inject.ENV_VAR, "kill_during_save@0#1")
    fault_inject.reset_fault_cache()
    try:
        fault_inject.maybe_kill_run("kill_during_save", 0, 2)  # another rollout: nothing happens
        with pytest.raises(RuntimeError, match="not the run's train.py; start the run as its own session"):
            fault_inject.maybe_kill_run("kill_during_save", 0, 1)
    finally:
        monkeypatch.delenv(fault_inject.ENV_VAR)
        fault_inject.reset_fault_cache()


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from slime.tools.demo_prompts import write_prompts
    from slime.tools.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("resume")
    return {"root": root, "checkpoint": Path(write_tiny_checkpoint(root / "tiny-qwen3")),
            "prompts": write_prompts(root / "prompts.jsonl", n=12, seed=0)}


def flags(assets, save: Path, metrics: Path) -> list[str]:
    return [
        "--hf-checkpoint", str(assets["checkpoint"]), "--prompt-data", str(assets["prompts"]),
        "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--custom-rm-path", f"{PLUGINS}:response_parity_rm",
        "--rollout-shuffle", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "8", "--num-steps-per-rollout", "1", "--num-rollout", str(NUM_ROLLOUT),
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
        "--rollout-num-gpus-per-engine", "1", "--use-slime-router",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512", "--advantage-estimator", "grpo",
        "--use-kl-loss", "--kl-loss-coef", "0.05", "--kl-loss-type", "low_var_kl", "--ref-update-interval", "2",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--lr", "1e-3", "--seed", "1234",
        "--save", str(save), "--save-interval", "1", "--metrics-jsonl", str(metrics), "--fence-timeout", "120",
    ]


def run_train(argv: list[str], *, fault: str | None = None) -> subprocess.CompletedProcess:
    """train.py as its own process group (the run-kill faults SIGKILL that group); whatever of the run
    outlives the driver is killed before this returns."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("SLIME_FAULT_INJECT", None)
    if fault:
        env["SLIME_FAULT_INJECT"] = fault
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        _kill_session(proc.pid)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _kill_session(sid: int, timeout_s: float = 30.0) -> None:
    """SIGKILL every process left in the run's session and wait until none is."""
    deadline = time.monotonic() + timeout_s
    while (pids := _session_pids(sid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    assert not _session_pids(sid), f"processes of the run outlived it: {_session_pids(sid)}"


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(entry)) == sid and not Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].startswith(" Z"):
                pids.append(int(entry))
        except OSError:  # gone meanwhile
            continue
    return pids


def events(path: Path) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            event = json.loads(line)
            out.setdefault(event["event"], {})[event["rollout_id"]] = event
    return out


def checkpoint_tensors(directory: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint (model and optimizer state), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    scratch.parent.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(str(directory), str(scratch))
    return {k: v for k, v in torch.load(scratch, weights_only=False).items() if isinstance(v, torch.Tensor)}


def iteration(root: Path, n: int) -> Path:
    return root / f"iter_{n:07d}"


@pytest.fixture(scope="module")
def reference(assets) -> dict:
    save, metrics = assets["root"] / "reference" / "ckpt", assets["root"] / "reference" / "metrics.jsonl"
    proc = run_train(flags(assets, save, metrics))
    assert proc.returncode == 0, proc.stderr[-5000:]
    recorded = events(metrics)
    assert sorted(recorded["train"]) == list(range(NUM_ROLLOUT))
    assert all(math.isfinite(recorded["train"][r]["train/loss"]) for r in range(NUM_ROLLOUT))
    return {"save": save, "events": recorded}


def assert_same_rollouts(got: dict, expected: dict, rollout_ids) -> None:
    for kind, keys in EXACT_KEYS.items():
        for rollout_id in rollout_ids:
            for key in keys:
                assert got[kind][rollout_id][key] == expected[kind][rollout_id][key], (kind, rollout_id, key)
    for kind, keys in CLOSE_KEYS.items():
        for rollout_id in rollout_ids:
            for key in keys:
                assert got[kind][rollout_id][key] == pytest.approx(expected[kind][rollout_id][key], abs=1e-5)


@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 120)  # the first one also runs the shared reference
@pytest.mark.parametrize("fault", sorted(KILL_POINTS))
def test_killed_run_resumes_to_the_uninterrupted_result(assets, reference, fault, tmp_path):
    save, first, resumed_metrics = tmp_path / "ckpt", tmp_path / "killed.jsonl", tmp_path / "resumed.jsonl"
    killed = run_train(flags(assets, save, first), fault=fault)
    assert killed.returncode == -signal.SIGKILL, f"{fault}: exit {killed.returncode}\n{killed.stderr[-3000:]}"
    start = KILL_POINTS[fault]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(start - 1)

    resumed = run_train([*flags(assets, save, resumed_metrics), "--load", str(save)])
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    got = events(resumed_metrics)
    assert sorted(got["train"]) == list(range(start, NUM_ROLLOUT))
    assert_same_rollouts(got, reference["events"], range(start, NUM_ROLLOUT))
    assert_same_rollouts(events(first), reference["events"], range(start - 1))  # before the kill, the same run

    final = NUM_ROLLOUT - 1
    for part in ("", "reference"):  # model + optimizer state, and the refreshed reference model
        name = f"{part or 'model'}.pt"
        want = checkpoint_tensors(iteration(reference["save"], final) / part, tmp_path / "want" / name)
        have = checkpoint_tensors(iteration(save, final) / part, tmp_path / "have" / name)
        assert sorted(have) == sorted(want)
        different = [k for k in want if not torch.equal(have[k], want[k])]
        assert different == [], f"{fault}: {len(different)} tensors differ, e.g. {different[:3]}"
    assert not list(save.glob("*.partial")), "a leftover partial save"
