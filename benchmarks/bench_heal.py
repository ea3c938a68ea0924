"""How long a self-healing restart takes when the trainer alone fails: the engines kept serving (the default)
against the engines restarted with the trainer (--restart-engines-on-heal), one run after the other.

    python benchmarks/bench_heal.py [--out outputs/bench-heal] [--json FILE] [-- FLAGS]

Each run is tests/test_exact_resume.py's setup (2 trainer ranks DP2, 2 embedded engines behind the project's
router, a tiny fp32 Qwen3 over a character vocabulary, a checkpoint after every rollout), 4 rollouts, with
rank 0's process SIGKILLed once in rollout 1's actor_train (SLIME_FAULT_INJECT=kill_rank_during_train@0#1) and
--max-restarts 1. The heal time is the run's own figure: `run/heal_s` of its `healed` event, from the driver
catching the failure to the first rollout of the restarted session trained, saved and pushed. FLAGS go to both
runs. On a GPU machine use benchmarks/run_colocate_gpu.sh's loop instead (benchmarks/RESULTS.md says how).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAULT = "kill_rank_during_train@0#1"


def assets(out: Path) -> tuple[Path, Path]:
    from slime.tools.demo_prompts import write_prompts
    from slime.tools.tiny_checkpoint import TinyQwen3Spec, write_tiny_checkpoint

    checkpoint = Path(write_tiny_checkpoint(out / "tiny-qwen3", TinyQwen3Spec(alphabet="0123456789")))
    return checkpoint, Path(write_prompts(out / "prompts.jsonl", n=6, seed=0, task="counting"))


def flags(checkpoint: Path, prompts: Path, save: Path, metrics: Path) -> list[str]:
    return [
        "--hf-checkpoint", str(checkpoint), "--prompt-data", str(prompts), "--input-key", "prompt",
        "--label-key", "label", "--custom-rm-path", "examples.counting_reward.reward", "--rollout-shuffle",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8",
        "--num-steps-per-rollout", "1", "--num-rollout", "4", "--actor-num-nodes", "1",
        "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "1",
        "--use-slime-router", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512",
        "--advantage-estimator", "grpo", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--lr", "1e-3",
        "--seed", "1234", "--save", str(save), "--save-interval", "1", "--metrics-jsonl", str(metrics),
        "--fence-timeout", "60", "--max-restarts", "1",
    ]


def run(name: str, argv: list[str], out: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "SLIME_FAULT_INJECT": FAULT}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=900)
    (out / f"{name}.stdout").write_text(proc.stdout)
    (out / f"{name}.stderr").write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    metrics = out / f"{name}.jsonl"
    healed = [e for e in map(json.loads, metrics.read_text().splitlines()) if e["event"] == "healed"]
    assert len(healed) == 1, healed
    return {"run": name, "heal_s": round(healed[0]["run/heal_s"], 1), "engines_kept": healed[0]["run/engines_kept"],
            "total_s": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench-heal")
    parser.add_argument("--json", type=Path, default=None)
    known, extra = parser.parse_known_args()
    extra = [f for f in extra if f != "--"]
    known.out.mkdir(parents=True, exist_ok=True)
    checkpoint, prompts = assets(known.out)
    results = []
    for name, more in (("engines_kept", []), ("engines_restarted", ["--restart-engines-on-heal"])):
        argv = [*flags(checkpoint, prompts, known.out / f"{name}-ckpt", known.out / f"{name}.jsonl"), *more, *extra]
        (known.out / f"{name}.jsonl").unlink(missing_ok=True)  # a fresh run each time
        shutil.rmtree(known.out / f"{name}-ckpt", ignore_errors=True)
        results.append(run(name, argv, known.out))
        print(json.dumps(results[-1]), flush=True)
    kept, restarted = results
    print(f"heal with the engines kept: {kept['heal_s']} s; with the engines restarted: {restarted['heal_s']} s "
          f"({restarted['heal_s'] / kept['heal_s']:.2f}x)")
    if known.json:
        known.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
