"""`python train.py` end to end through the sglang-router and the distributed weight transport, on the embedded
default.

- the default path: the real sglang-router (Rust, from the sglang-router package) in front of two embedded
  engines on their own bundles (not colocated), so weights travel SGLang's distributed way: the engines
  join a gloo group with the trainer's sender and receive broadcasts.
  The same run samples: over-sampling with the DAPO filter (group 0 scores flat and is dropped), partial
  rollout (the group in flight when the rollout has its groups is aborted on every engine the router
  lists, buffered and finished by the next rollout under the next weights).
One small run (2 engines, 2 rollouts); every assertion shares it. The other path (`--use-slime-router --colocate`:
the project's router, two ranks and two colocated engines, weights through the shared-memory tensor payload) is
checked on tests/test_logprob_agreement.py's healthy run, which takes that path.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import hook_plugins
from train_runs import assert_key_reaches_no_log, read_events, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

COMMON = [
    "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--rm-type", "math",
    "--rollout-num-gpus-per-engine", "1", "--num-rollout", "2", "--rollout-batch-size", "2",
    "--n-samples-per-prompt", "2", "--num-steps-per-rollout", "1", "--rollout-max-response-len", "8",
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl",
    "--lr", "1e-4", "--seed", "1234", "--fence-timeout", "120", "--use-dynamic-batch-size",
    "--max-tokens-per-gpu", "512",
]
PLUGINS = str(Path(hook_plugins.__file__).resolve())
SEPARATE = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2"]
LAYOUTS = {
    # 4 groups drawn for 2; one request per engine at a time, so the groups generate one after another, and
    # each sample waits 0.5 s before its reward: the last group is mid-generation when the rollout is full
    "sglang_router": [
        *SEPARATE, "--over-sampling-batch-size", "4", "--sglang-server-concurrency", "1",
        "--dynamic-sampling-filter-path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
        "--custom-rm-path", f"{PLUGINS}:first_group_flat_rm", "--rollout-sample-hook-path", f"{PLUGINS}:slow_sample_hook",
        "--partial-rollout", "--rollout-max-response-len", "256"],
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory, small_run_inputs) -> dict[str, Path]:
    return {**small_run_inputs, "root": tmp_path_factory.mktemp("stack")}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def run(request, assets) -> dict:
    name = request.param
    out = assets["root"] / name
    flags = ["--hf-checkpoint", str(assets["checkpoint"]), "--prompt-data", str(assets["prompts"]), *COMMON,
             *LAYOUTS[name], "--metrics-jsonl", str(out / "metrics.jsonl"), "--ledger-dir", str(out / "ledger"),
             "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.pt")]
    out.mkdir()
    proc, seconds = run_train(flags, timeout_s=540)
    return {"name": name, "proc": proc, "out": out, "seconds": seconds}


def test_train_runs_every_rollout_and_pushes_every_version(run):
    proc = run["proc"]
    assert proc.returncode == 0, f"{run['name']}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    events = read_events(run["out"] / "metrics.jsonl")
    assert [e["rollout_id"] for e in events["rollout"]] == [0, 1]
    assert all(e["rollout/num_samples"] == 4 for e in events["rollout"])
    assert [e["rollout_id"] for e in events["train"]] == [0, 1]
    assert all(math.isfinite(e["train/loss"]) for e in events["train"])
    sync = events["weight_sync"]
    # the push at start (the trainer's initial weights, version 0), then one after each rollout
    assert [(e["rollout_id"], e["weight_sync/version"]) for e in sync] == [(-1, 0), (0, 1), (1, 2)]
    assert all(e["weight_sync/bytes"] > 0 and e["weight_sync/send_seconds"] > 0 for e in sync)


def test_the_intended_router_served_the_rollouts(run):
    assert run["proc"].returncode == 0, "the run failed"
    logs = sorted((run["out"] / "ledger" / "engine-logs").iterdir())
    routers = [p for p in logs if p.name.startswith("sglang-router-")]
    engines = [p for p in logs if p.name.startswith("embedded-engine-")]
    assert len(routers) == 1 and len(engines) == 2, [p.name for p in logs]
    for engine in engines:  # each engine took every push
        text = engine.read_text()
        assert "updated" in text and "weight_version=2" in text, engine.name
    assert all("joined weight-update group" in e.read_text() for e in engines)


def test_the_run_key_reaches_no_log(run):
    """The router and the distributed weight transport authenticate with the run's key (here from $SLIME_API_KEY,
    as tests/conftest.py set it), and neither the run's output nor any file it wrote holds it."""
    assert run["proc"].returncode == 0, "the run failed"
    assert_key_reaches_no_log(run["proc"], run["out"])


def _engine_logs(run) -> list[str]:
    return [p.read_text() for p in sorted((run["out"] / "ledger" / "engine-logs").glob("embedded-engine-*"))]


SAMPLING_RUN = pytest.mark.parametrize("run", ["sglang_router"], indirect=True)


@SAMPLING_RUN
def test_over_sampling_drops_flat_groups_behind_the_real_router(run):
    assert run["proc"].returncode == 0, run["proc"].stderr[-4000:]
    first = read_events(run["out"] / "metrics.jsonl")["rollout"][0]
    assert first["rollout/sampling/drawn_groups"] == 4.0 and first["rollout/dynamic_filter/drop_zero_std_0.0"] == 1.0
    kept = torch.load(run["out"] / "rollout_0.pt", weights_only=False)["samples"]
    assert sorted({s["group_index"] for s in kept}) == [1, 2]  # group 0 (all rewards 0) was dropped
    assert first["rollout/zero_std_group_ratio"] == 0.0


@SAMPLING_RUN
def test_partial_rollout_aborts_on_every_engine_and_resumes_behind_the_real_router(run):
    """GET /workers gave the abort both engines; the aborted group came back first in the next rollout."""
    assert run["proc"].returncode == 0, run["proc"].stderr[-4000:]
    first = read_events(run["out"] / "metrics.jsonl")["rollout"][0]
    assert first["rollout/partial/buffered_groups"] == 1.0 and first["rollout/partial/buffered_tokens"] > 0
    logs = _engine_logs(run)
    assert len(logs) == 2 and all("abort_request (all)" in log for log in logs)
    resumed = [s for s in torch.load(run["out"] / "rollout_1.pt", weights_only=False)["samples"]
               if s["metadata"].get("start_rollout_id") == 0]
    assert resumed and all(s["group_index"] == 3 for s in resumed), resumed  # the group in flight in rollout 0
    for sample in resumed:  # tokens from the weights of rollout 0 and from those pushed after it
        assert sample["status"] in ("completed", "truncated"), sample["status"]
        assert sample["weight_versions"][0] == "0" and sample["weight_versions"][-1] == "1", sample["weight_versions"]
