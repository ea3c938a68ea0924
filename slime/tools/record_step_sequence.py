"""Record upstream #1487's layout with every rank's whole collective sequence; optionally check and render it.

    python -m slime.tools.record_step_sequence --out DIR [--doc docs/step_sequence.md] [-- train.py flags]

Runs `python train.py` on the embedded CPU default with upstream #1487's layout (8 ranks = TP2 x SP x CP4,
--colocate, dynamic batches, per-token loss, one embedded engine over the 8 ranks' GPUs, the project's router)
for 2 rollouts, each of 2 steps, with `--ledger-record-sequence`: DIR/ledger/sequence_rank<N>.jsonl.
The prompts alternate a short and a long one and each step trains on one prompt's samples, so
the two steps of a rollout get different micro-batch counts under the token budget, and no
sequence fills its CP slices evenly. With --doc, the order proof is checked and rollout 1 is
rendered there (`make step-sequence` regenerates docs/step_sequence.md). Flags after `--` go to
train.py after these (the parser keeps the last value: `-- --context-parallel-size 2`).
tests/test_order_proof.py runs the same configuration.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROMPTS = (  # short, long, short, long: one prompt per training step (2 prompts x 4 samples, 2 steps)
    {"prompt": "What is 2 + 3?", "label": "5"},
    {"prompt": "A farmer has 12 sheep and buys 7 more, then sells 4 of them at the market. How many sheep "
               "does the farmer have now? Put the final answer in \\boxed{}.", "label": "15"},
    {"prompt": "What is 4 + 4?", "label": "8"},
    {"prompt": "A baker bakes 9 loaves in the morning and 6 more in the afternoon, then gives 5 loaves away "
               "to neighbours. How many loaves are left? Put the final answer in \\boxed{}.", "label": "10"},
)

ISSUE_LAYOUT = (
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "4",
    # budget 48 x 4 tokens per micro-batch: one for the short prompt's 4 samples, two for the long one's
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "48", "--calculate-per-token-loss",
    # one engine over the 8 GPUs, as SGLang with TP 8 (the ranks' collectives are those of one engine per rank)
    "--use-slime-router", "--rollout-num-gpus-per-engine", "8", "--sglang-mem-fraction-static", "0.7",
)

RUN = (
    "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--rm-type", "math",
    "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2",
    "--rollout-max-response-len", "12", "--advantage-estimator", "grpo",
    "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.001",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--lr", "1e-4", "--seed", "1234",
)


def write_assets(out: Path) -> None:
    """The tiny Qwen3 checkpoint and the prompts, once per output directory."""
    from slime.tools.tiny_checkpoint import write_tiny_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tiny-qwen3" / "config.json").exists():
        write_tiny_checkpoint(out / "tiny-qwen3")
    (out / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))


def train_flags(out: Path, *, fence_timeout: float = 120) -> list[str]:
    """train.py's flags for a recording into `out` (assets from write_assets)."""
    return [
        "--hf-checkpoint", str(out / "tiny-qwen3"), "--prompt-data", str(out / "prompts.jsonl"),
        *ISSUE_LAYOUT, *RUN, "--fence-timeout", str(fence_timeout),
        "--metrics-jsonl", str(out / "metrics.jsonl"),
        "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.pt"),
        "--ledger-dir", str(out / "ledger"), "--ledger-record-sequence",
    ]


def record(out: Path, extra: list[str] = (), *, timeout_s: float = 900, env: dict | None = None,
           fence_timeout: float = 120) -> subprocess.CompletedProcess:
    """One `python train.py` recording (assets written first); returns the finished process."""
    write_assets(out)
    shutil.rmtree(out / "ledger", ignore_errors=True)  # no file of an earlier run may mix in
    (out / "metrics.jsonl").unlink(missing_ok=True)
    run_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *train_flags(out, fence_timeout=fence_timeout),
                           *extra], cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout_s)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/step_sequence", help="assets, metrics and ledger go here")
    parser.add_argument("--doc", default=None, help="check the order proof and render rollout 1 into this file")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    out = Path(args.out).resolve()
    proc = record(out, extra)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        return proc.returncode
    if args.doc:
        from slime.distributed.order_proof import check_order, read_sequences
        from slime.tools.render_step_sequence import render

        sequences = read_sequences(str(out / "ledger"))
        report = check_order(sequences)
        print(report.format())
        if not report.ok:
            return 1
        Path(args.doc).write_text(render(sequences, rollout_index=1, rank=0))
        print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
