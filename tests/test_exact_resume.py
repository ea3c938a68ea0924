"""A run killed with SIGKILL (driver and every process of it) and resumed with --load continues exactly:
the same per-rollout metrics and bit-identical final weights, optimizer state and reference model as one
uninterrupted run of the same length.

Two chains of `train.py` runs share the work (2 ranks, DP 2, two embedded engines behind the project's
router, a character-vocabulary tiny Qwen3 in fp32, a checkpoint after every rollout, the reference
refreshed every 2 rollouts, shuffled prompts over 2 epochs):

  reference  one uninterrupted run of 4 rollouts
  chain      the same run, killed and resumed four times, each kill injected deterministically
             (slime/distributed/fault_inject.py, RUN_KILL_KINDS):
               1. while rollout 1 generates                               -> resumes at 1
               2. in rollout 2's actor_train                              -> resumes at 2
               3. in rollout 2's weight sync (checkpoint 2 published)     -> resumes at 3
               4. in rollout 3's checkpoint save, after rank 1's shards   -> resumes at 3, to the end

Each resume starts from a checkpoint the previous segment wrote, three of them written by resumed runs;
from checkpoint 1 on, the reference model (refreshed after rollout 1) differs from --ref-load's weights.
One test per kill point checks that the segment died at that point and that what the next segment
computed equals the reference's; the last checks the final checkpoint bit for bit.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import hook_plugins
from slime.checkpoint.contents import data_file, rng_file
from train_runs import run_train_session, write_run_assets

pytestmark = pytest.mark.e2e

PLUGINS = str(Path(hook_plugins.__file__).resolve())
NUM_ROLLOUT = 4
NUM_PROMPTS = 6  # 3 rollouts of 2 prompts an epoch: rollout 3 starts the second epoch's shuffle
RUN_TIMEOUT_S = 300  # one run: ~45 s to start and ~5 s a rollout on 2 idle cores
# per-rollout metrics that must agree exactly: they depend only on the tokens, the weights and the optimizer
EXACT_KEYS = {"train": ("train/loss", "train/grad_norm", "train/kl_loss", "train/pg_loss"),
              "rollout": ("rollout/raw_reward", "rollout/response_len/mean")}
# the engines' log-probs come from batches of whatever requests were in flight: equal up to fp32 rounding
CLOSE_KEYS = {"train": ("train/train_rollout_logprob_abs_diff",)}


@dataclass(frozen=True)
class Kill:
    kind: str
    rank: int
    rollout_id: int

    @property
    def spec(self) -> str:
        return f"{self.kind}@{self.rank}#{self.rollout_id}"

    @property
    def resumes_at(self) -> int:
        """The rollout after the last checkpoint published before the kill."""
        return self.rollout_id + 1 if self.kind == "kill_during_weight_sync" else self.rollout_id


KILLS = (Kill("kill_during_rollout", 0, 1), Kill("kill_during_train", 0, 2),
         Kill("kill_during_weight_sync", 0, 2), Kill("kill_during_save", 1, 3))
CHAIN_TIMEOUT_S = (2 + len(KILLS)) * RUN_TIMEOUT_S + 120  # the reference and every segment


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
    from slime.tools.tiny_checkpoint import TinyQwen3Spec

    return write_run_assets(tmp_path_factory.mktemp("resume"), TinyQwen3Spec(alphabet="0123456789"),
                            prompts=NUM_PROMPTS, task="counting")


def flags(assets, save: Path, metrics: Path) -> list[str]:
    return [
        "--hf-checkpoint", str(assets["checkpoint"]), "--prompt-data", str(assets["prompts"]),
        "--input-key", "prompt", "--label-key", "label", "--custom-rm-path", f"{PLUGINS}:response_parity_rm",
        "--rollout-shuffle", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "8", "--num-steps-per-rollout", "1", "--num-rollout", str(NUM_ROLLOUT),
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
        "--rollout-num-gpus-per-engine", "1", "--use-slime-router",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512", "--advantage-estimator", "grpo",
        "--use-kl-loss", "--kl-loss-coef", "0.05", "--kl-loss-type", "low_var_kl", "--ref-update-interval", "2",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--lr", "1e-3", "--seed", "1234",
        "--save", str(save), "--save-interval", "1", "--metrics-jsonl", str(metrics), "--fence-timeout", "120",
    ]


def run_train(argv: list[str], *, fault: str | None = None, timeout_s: float = RUN_TIMEOUT_S
              ) -> subprocess.CompletedProcess:
    """train.py as its own session on its own cluster (the run-kill faults SIGKILL that session): nothing of the
    run outlives it, its engine servers included."""
    try:
        proc = run_train_session(argv, timeout_s=timeout_s, env_extra={"SLIME_FAULT_INJECT": fault} if fault else None)
    finally:
        servers = _servers_left(argv[argv.index("--hf-checkpoint") + 1])
    assert not servers, f"engine servers outlived the run (each dies with its engine actor): {servers}"
    return proc


def _servers_left(checkpoint: str, timeout_s: float = 15.0) -> list[str]:
    """Engine servers of the run (their command line names its checkpoint) still running after it; they lead
    process groups of their own, outside the run's session, and go when their engine actor goes."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                command = Path(f"/proc/{entry}/cmdline").read_text().replace("\0", " ")
                running = not Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].startswith(" Z")
            except OSError:
                continue
            if running and checkpoint in command and "train.py" not in command:
                left.append(f"{entry}: {command[:160]}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def events(path: Path) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            event = json.loads(line)
            out.setdefault(event["event"], {})[event["rollout_id"]] = event
    return out


def latest(save: Path) -> int | None:
    tracker = save / "latest_checkpointed_iteration.txt"
    return int(tracker.read_text().strip()) if tracker.exists() else None


def iteration(root: Path, n: int) -> Path:
    return root / f"iter_{n:07d}"


@dataclass(frozen=True)
class Segment:
    """One train.py run of the chain and what it left behind."""

    fault: str | None
    proc: subprocess.CompletedProcess
    events: dict[str, dict[int, dict]]
    latest: int | None  # the tracker's iteration after the run
    files: frozenset[str]  # what --save held after the run (later segments add to it), relative paths


@pytest.fixture(scope="module")
def reference(assets) -> dict:
    save, metrics = assets["root"] / "reference" / "ckpt", assets["root"] / "reference" / "metrics.jsonl"
    proc = run_train(flags(assets, save, metrics))
    assert proc.returncode == 0, proc.stderr[-5000:]
    recorded = events(metrics)
    assert sorted(recorded["train"]) == list(range(NUM_ROLLOUT))
    assert all(math.isfinite(recorded["train"][r]["train/loss"]) for r in range(NUM_ROLLOUT))
    return {"save": save, "events": recorded}


@pytest.fixture(scope="module")
def chain(assets, reference) -> dict:
    """The chain's segments in order: one per kill, then the run to the end. A segment that did not die
    as its kill says ends the chain there (the tests of the later kill points then say so)."""
    root = assets["root"] / "chain"
    save = root / "ckpt"
    segments: list[Segment] = []
    for index, fault in enumerate([*(kill.spec for kill in KILLS), None]):
        metrics = root / f"segment{index}.jsonl"
        argv = [*flags(assets, save, metrics), *(["--load", str(save)] if index else [])]
        proc = run_train(argv, fault=fault)
        segments.append(Segment(fault, proc, events(metrics), latest(save), saved_files(save)))
        if fault is not None and proc.returncode != -signal.SIGKILL:
            break
    return {"save": save, "segments": segments}


def saved_files(save: Path) -> frozenset[str]:
    """The iteration directories, their RNG files and the data-position files under --save."""
    found = (*save.glob("iter_*"), *save.glob("iter_*/rng/*"), *save.glob("rollout/*"))
    return frozenset(str(p.relative_to(save)) for p in found)


def segment(chain: dict, index: int) -> Segment:
    segments = chain["segments"]
    assert index < len(segments), (f"segment {index} never ran: segment {len(segments) - 1} ({segments[-1].fault}) "
                                   f"ended with exit {segments[-1].proc.returncode}\n{segments[-1].proc.stderr[-3000:]}")
    return segments[index]


def assert_same_rollouts(got: dict, expected: dict, rollout_ids, label: str) -> None:
    for kind, keys in EXACT_KEYS.items():
        for rollout_id in rollout_ids:
            assert rollout_id in got.get(kind, {}), f"{label}: no {kind} event for rollout {rollout_id}"
            for key in keys:
                assert got[kind][rollout_id][key] == expected[kind][rollout_id][key], (label, kind, rollout_id, key)
    for kind, keys in CLOSE_KEYS.items():
        for rollout_id in rollout_ids:
            for key in keys:
                assert got[kind][rollout_id][key] == pytest.approx(expected[kind][rollout_id][key], abs=1e-5), \
                    (label, kind, rollout_id, key)


def assert_died_at(seg: Segment, kill: Kill) -> None:
    """The segment was SIGKILLed where `kill` says: what it logged and published stops exactly there."""
    k, published = kill.rollout_id, iteration(Path(), kill.rollout_id).name
    assert seg.proc.returncode == -signal.SIGKILL, f"{kill.spec}: exit {seg.proc.returncode}\n{seg.proc.stderr[-3000:]}"
    assert seg.latest == kill.resumes_at - 1, f"{kill.spec}: checkpoint {seg.latest} was the last one published"
    generated, trained, synced = (set(seg.events.get(kind, {})) for kind in ("rollout", "train", "weight_sync"))
    if kill.kind == "kill_during_rollout":  # nothing of rollout k: not even its data position
        assert k not in generated and k - 1 in trained and k - 1 in synced
        assert data_file("", k) not in seg.files
    elif kill.kind == "kill_during_train":  # generated, not trained
        assert k in generated and k not in trained
        assert f"Timer actor_train start (rollout {k})" in seg.proc.stderr
    elif kill.kind == "kill_during_save":  # trained; rank 1's shards on disk, the iteration unpublished
        assert k in trained and k not in synced
        assert rng_file(f"{published}.partial", kill.rank) in seg.files and published not in seg.files, \
            sorted(seg.files)
    else:  # kill_during_weight_sync: trained and published, never pushed
        assert kill.kind == "kill_during_weight_sync"
        assert k in trained and k not in synced and published in seg.files, sorted(seg.files)


def resumed_rollouts(seg: Segment) -> range:
    """The rollouts a resumed segment trained: from the one after its --load checkpoint."""
    trained = sorted(seg.events.get("train", {}))
    return range(trained[0], trained[-1] + 1) if trained else range(0)


@pytest.mark.timeout(CHAIN_TIMEOUT_S)  # the first test also runs the reference and the whole chain
@pytest.mark.parametrize("index", range(len(KILLS)), ids=[kill.kind for kill in KILLS])
def test_killed_run_resumes_to_the_uninterrupted_result(chain, reference, index):
    kill = KILLS[index]
    killed, resumed = segment(chain, index), segment(chain, index + 1)
    assert_died_at(killed, kill)
    before = sorted(killed.events.get("train", {}))  # what the killed segment finished is the reference's too
    assert_same_rollouts(killed.events, reference["events"], before, f"before {kill.spec}")
    assert resumed.events["weight_sync"].get(kill.resumes_at - 1), "the resumed run's first push is missing"
    rollouts = resumed_rollouts(resumed)
    assert rollouts and rollouts[0] == kill.resumes_at, f"after {kill.spec}: trained {list(rollouts)}"
    assert_same_rollouts(resumed.events, reference["events"], rollouts, f"after {kill.spec}")
    # the data file holds every item the load reads: the rollout manager warns of nothing missing
    assert "data-source state has no" not in resumed.proc.stderr, resumed.proc.stderr[-3000:]


def checkpoint_tensors(directory: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint (model and optimizer state), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    scratch.parent.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(str(directory), str(scratch))
    return {k: v for k, v in torch.load(scratch, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.mark.timeout(CHAIN_TIMEOUT_S)
def test_the_chain_ends_with_the_uninterrupted_run_s_weights(chain, reference, tmp_path):
    last = segment(chain, len(KILLS))
    assert last.proc.returncode == 0, last.proc.stderr[-5000:]
    assert sorted(last.events["train"])[-1] == NUM_ROLLOUT - 1 and last.latest == NUM_ROLLOUT - 1
    final = NUM_ROLLOUT - 1
    for part in ("", "reference"):  # model + optimizer state, and the refreshed reference model
        name = f"{part or 'model'}.pt"
        want = checkpoint_tensors(iteration(reference["save"], final) / part, tmp_path / "want" / name)
        have = checkpoint_tensors(iteration(chain["save"], final) / part, tmp_path / "have" / name)
        assert sorted(have) == sorted(want)
        different = [k for k in want if not torch.equal(have[k], want[k])]
        assert different == [], f"{part or 'model'}: {len(different)} tensors differ, e.g. {different[:3]}"
    assert not list(chain["save"].glob("*.partial")), "a leftover partial save"


@pytest.mark.timeout(CHAIN_TIMEOUT_S)
def test_load_without_the_data_position_names_the_file_and_the_flag(assets, chain, tmp_path):
    """A checkpoint whose data-position file is gone: the run stops with the file and the flag that accepts
    starting from the first prompt, instead of silently replaying the first prompts."""
    final = NUM_ROLLOUT - 1
    save = tmp_path / "ckpt"
    save.mkdir()
    shutil.copytree(iteration(chain["save"], final), iteration(save, final))
    shutil.copy(chain["save"] / "latest_checkpointed_iteration.txt", save)
    argv = flags(assets, save, tmp_path / "metrics.jsonl")
    argv[argv.index("--num-rollout") + 1] = str(NUM_ROLLOUT + 1)
    proc = run_train([*argv, "--load", str(save)])
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Started a local Ray instance" not in proc.stderr, "named before Ray starts:\n" + proc.stderr[-3000:]
    assert os.path.basename(data_file("", final)) in proc.stderr and "--allow-fresh-data-position" in proc.stderr, \
        proc.stderr[-3000:]


# --max-restarts: one run, two named failures healed in it, each once (slime/distributed/fault_inject.py,
# RANK_FAULT_KINDS): rank 0's process dies in rollout 1's actor_train (-> back to checkpoint 0), then rank 1
# blocks in rollout 2's actor_train until its watchdog ends it (-> back to checkpoint 1).
HEAL_FAULTS = "kill_rank_during_train@0#1,stall_rank_during_train@1#2"
HEAL_FENCE_TIMEOUT_S = 20  # how long the stalled rank blocks before its watchdog names it
HEAL_TIMEOUT_S = 3 * RUN_TIMEOUT_S


@pytest.fixture(scope="module")
def healed(assets) -> dict:
    root = assets["root"] / "healed"
    save, metrics = root / "ckpt", root / "metrics.jsonl"
    argv = flags(assets, save, metrics)
    argv[argv.index("--fence-timeout") + 1] = str(HEAL_FENCE_TIMEOUT_S)
    started = time.monotonic()
    proc = run_train([*argv, "--max-restarts", "2", "--restart-window-rollouts", "1"], fault=HEAL_FAULTS,
                     timeout_s=HEAL_TIMEOUT_S)
    print(f"healed run: {time.monotonic() - started:.0f}s")
    (root / "stdout.txt").write_text(proc.stdout)  # its timeline, for a look after the test
    (root / "stderr.txt").write_text(proc.stderr)
    return {"save": save, "proc": proc, "events": events(metrics)}


@pytest.mark.timeout(HEAL_TIMEOUT_S + RUN_TIMEOUT_S + 120)  # the reference run and the healed one
def test_a_healed_run_ends_as_the_uninterrupted_run(healed, reference, tmp_path):
    proc = healed["proc"]
    assert proc.returncode == 0, proc.stderr[-5000:]
    restarts = [line for line in proc.stderr.splitlines() if "restart " in line and " of 2: " in line]
    assert len(restarts) == 2, proc.stderr[-5000:]
    assert "ranks [0], rollout 1); going back to checkpoint 0, resuming at rollout 1" in restarts[0], restarts
    assert "rollout 2); going back to checkpoint 1, resuming at rollout 2" in restarts[1], restarts
    assert "1" in restarts[1].partition("(actor ranks [")[2].partition("]")[0], restarts  # the stalled rank is named
    logged = healed["events"]["restart"]
    assert {r: (e["run/restarts"], e["run/restart_checkpoint"]) for r, e in logged.items()} == {1: (1, 0), 2: (2, 1)}
    # both failures were the trainer's alone: the engines served on, on the same ports, through both restarts,
    # got the checkpoint's weights pushed, and the run is still the uninterrupted one (below)
    engines = {r: [e["url"] for e in event["placement/engines"]] for r, event in healed["events"]["placement"].items()}
    assert sorted(engines) == [0, 1, 2] and engines[0] == engines[1] == engines[2], engines  # one per session
    assert proc.stdout.count("engines: kept, starting their manager") == 2, proc.stdout[-3000:]
    assert all(healed["events"]["weight_sync"].get(r) for r in (0, 1)), "the restarted trainer's first push is missing"
    heals = healed["events"]["healed"]
    assert sorted(heals) == [1, 2] and all(e["run/engines_kept"] == 1 and e["run/heal_s"] > 0 for e in heals.values())
    print("heal seconds (engines kept):", {r: round(e["run/heal_s"], 1) for r, e in heals.items()})
    # the temp ledger dir the run made (it names it on stderr) went with the run that ended cleanly
    ledger = proc.stderr.partition("ledger dir: ")[2].partition(" ")[0]
    assert ledger and not os.path.exists(ledger), ledger
    # every rollout's last account (a failed attempt's partial one is replaced) is the reference's
    assert_same_rollouts(healed["events"], reference["events"], range(NUM_ROLLOUT), "healed")
    final = NUM_ROLLOUT - 1
    for part in ("", "reference"):
        name = f"{part or 'model'}.pt"
        want = checkpoint_tensors(iteration(reference["save"], final) / part, tmp_path / "want" / name)
        have = checkpoint_tensors(iteration(healed["save"], final) / part, tmp_path / "have" / name)
        assert sorted(have) == sorted(want)
        assert [k for k in want if not torch.equal(have[k], want[k])] == [], part or "model"
