"""The counting demo learns on a gated DeltaNet hybrid: a random-init tiny Qwen3.5-MoE (one DeltaNet and one gated
attention layer, 4 experts top-2 and a gated shared expert per layer) through examples/run_cpu_demo_moe.sh on 4 CPU
ranks as TP2 x SP x CP2 x EP2 (--colocate, dynamic batches, per-token loss; the DeltaNet's recurrence crosses the
CP ranks, the experts are spread over the expert-parallel ranks).

As tests/test_learning_demo.py asks of the dense model: the mean reward of the last 3 rollouts is well above
rollout 0's, and after every weight sync the engine (transformers' Qwen3_5MoeForCausalLM, served the pushed
weights) gives the trainer's log-probs in fp32. One run covers the family's layers under every parallelism the
two text types share (the dense Qwen3.5 differs in its MLP only, which the Qwen3 demo's learning run and
tests/test_qwen3_5.py's parity tests at TP2 x CP2 cover).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_learning_demo import MIN_RISE, NUM_ROLLOUTS, _series
from tiny_models import replace_model, save_tiny_qwen3_5_moe
from train_runs import PRIVATE_CLUSTER, train_env

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
SEED = 1234
# the demo's Qwen3 sizes (slime/tools/tiny_checkpoint.py) with one layer of each kind
# trainer vs engine (transformers' class after the push), fp32 on CPU: tighter than the demo's 1e-4
AGREEMENT = 1e-6
# ~200 s in the suite on idle cores, 434 s once on a CI host under load: the deadline is for a hang
RUN_TIMEOUT_S = 800
SIZES = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], intermediate_size=128,
             initializer_range=0.02)


def _run(script: str, model_name: str, save, out: Path, extra: tuple[str, ...]) -> list[dict]:
    """examples/<script> on a Qwen3.5 checkpoint put where the script looks for its model (it writes a Qwen3
    only when none is there)."""
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

    model = write_tiny_checkpoint(out / f"{model_name}-seed{SEED}", TinyQwen3Spec(alphabet="0123456789", seed=SEED))
    replace_model(model, lambda path, **ids: save(path, seed=SEED, **{**SIZES, **ids}))
    env = train_env({"OUT": str(out), "NUM_ROLLOUT": str(NUM_ROLLOUTS), "PY": sys.executable, "SEED": str(SEED),
                     **PRIVATE_CLUSTER})
    proc = subprocess.run(["bash", str(ROOT / "examples" / script), *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_learns_and_agrees(events: list[dict]) -> None:
    rewards = _series(events, "rollout", "rollout/raw_reward")
    assert len(rewards) == NUM_ROLLOUTS
    rise = sum(rewards[-3:]) / 3 - rewards[0]
    assert rise >= MIN_RISE, f"rewards {[round(r, 3) for r in rewards]}"
    diffs = _series(events, "train", "train/train_rollout_logprob_abs_diff")
    assert len(diffs) == NUM_ROLLOUTS and all(0.0 <= d <= AGREEMENT for d in diffs), diffs
    assert _series(events, "weight_sync", "weight_sync/version") == list(range(NUM_ROLLOUTS + 1))


@pytest.mark.timeout(RUN_TIMEOUT_S + 40)
def test_qwen3_5_moe_learns_under_tp2_sp_cp2_ep2(tmp_path):
    extra = ("--actor-num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "4", "--context-parallel-size", "2",
             "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--num-experts", "4",
             "--moe-router-topk", "2", "--moe-shared-expert-gate")
    _assert_learns_and_agrees(_run("run_cpu_demo_moe.sh", "counting-moe", save_tiny_qwen3_5_moe, tmp_path, extra))
