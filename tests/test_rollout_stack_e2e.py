"""`python train.py` end to end through both routers and both weight transports, on the embedded default.

- default path: the real sglang-router (Rust, from the sglang-router package) in front of two embedded
  engines on their own bundles (not colocated), so weights travel SGLang's distributed way: the engines
  join a gloo group with the trainer's sender and receive broadcasts.
- `--use-slime-router --colocate`: the project's router, two ranks and two colocated engines, weights
  through the shared-memory tensor payload.
One small run each (2 engines, 2 rollouts); every assertion shares it.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from test_end_to_end import read_events, run_train

pytestmark = pytest.mark.timeout(600)

COMMON = [
    "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--rm-type", "math",
    "--rollout-num-gpus-per-engine", "1", "--num-rollout", "2", "--rollout-batch-size", "2",
    "--n-samples-per-prompt", "2", "--num-steps-per-rollout", "1", "--rollout-max-response-len", "8",
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl",
    "--lr", "1e-4", "--seed", "1234", "--fence-timeout", "120", "--use-dynamic-batch-size",
    "--max-tokens-per-gpu", "512",
]
LAYOUTS = {
    "sglang_router": ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2"],
    "slime_router": ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--colocate",
                     "--use-slime-router"],
}
ROUTER_LOG = {"sglang_router": "sglang-router-", "slime_router": "slime-router-"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from slime.tools.demo_prompts import write_prompts
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("stack")
    prompts = root / "prompts.jsonl"
    write_prompts(prompts, n=8, seed=0)
    return {"root": root, "checkpoint": Path(write_tiny_checkpoint(root / "tiny", TinyQwen3Spec(layers=1))),
            "prompts": prompts}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def run(request, assets) -> dict:
    name = request.param
    out = assets["root"] / name
    flags = ["--hf-checkpoint", str(assets["checkpoint"]), "--prompt-data", str(assets["prompts"]), *COMMON,
             *LAYOUTS[name], "--metrics-jsonl", str(out / "metrics.jsonl"), "--ledger-dir", str(out / "ledger")]
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
    routers = [p for p in logs if p.name.startswith(ROUTER_LOG[run["name"]])]
    engines = [p for p in logs if p.name.startswith("embedded-engine-")]
    assert len(routers) == 1 and len(engines) == 2, [p.name for p in logs]
    for engine in engines:  # each engine took every push
        text = engine.read_text()
        assert "updated" in text and "weight_version=2" in text, engine.name
    if run["name"] == "sglang_router":
        assert all("joined weight-update group" in e.read_text() for e in engines)


def test_the_run_key_reaches_no_log(run):
    """Both routers and both weight transports authenticate with the run's key (here from $SLIME_API_KEY,
    as tests/conftest.py set it), and neither the run's output nor any file it wrote holds it."""
    from slime.utils.security import current_key

    assert run["proc"].returncode == 0, "the run failed"
    key = current_key().reveal()
    assert key not in run["proc"].stdout + run["proc"].stderr
    written = [p for p in run["out"].rglob("*") if p.is_file()]
    assert any(p.name.startswith("embedded-engine-") for p in written)
    assert not [p for p in written if key in p.read_text(errors="replace")]
