"""Render one rollout's recorded collective sequence into a Markdown page (docs/step_sequence.md).

    python -m slime.tools.render_step_sequence LEDGER_DIR --out docs/step_sequence.md [--rollout 1] [--rank 0]

LEDGER_DIR is the --ledger-dir of a run made with --ledger-record-sequence (`make step-sequence`
records one with upstream #1487's layout and renders it). The page lists the phases of one rollout in
the order they ran (wake, plan, log-probs, each training step, exit, sleep, the weight sync) and,
per phase, the collectives of every group as one rank recorded them; repeats are folded
("(a, b) x2"). The order proof (slime.distributed.order_proof) is run on the same files and its
verdict printed on the page: every other member of each group recorded the same sequence.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from slime.distributed.order_proof import RankSequence, SequenceOp, check_order, read_sequences

MAX_PERIOD = 16  # longest repeating block folded into "(...) xN"
TRAIN_PREFIX = "actor_train/"


@dataclass(frozen=True)
class PhaseRun:
    """Consecutive ops of one rank recorded under one phase."""

    phase: str
    ops: tuple[SequenceOp, ...]


def rollout_windows(sequence: RankSequence) -> list[tuple[SequenceOp, ...]]:
    """The ops of each rollout: from an entry into actor_train (its wake) to the next one."""
    windows: list[list[SequenceOp]] = []
    previous = ""
    for op in sequence.ops:
        if op.phase.startswith(TRAIN_PREFIX) and not previous.startswith(TRAIN_PREFIX):
            windows.append([])
        if windows:
            windows[-1].append(op)
        previous = op.phase
    return [tuple(w) for w in windows]


def phase_runs(ops: tuple[SequenceOp, ...]) -> list[PhaseRun]:
    runs: list[list[SequenceOp]] = []
    for op in ops:
        if not runs or runs[-1][0].phase != op.phase:
            runs.append([])
        runs[-1].append(op)
    return [PhaseRun(run[0].phase, tuple(run)) for run in runs]


def op_text(op: SequenceOp) -> str:
    """e.g. 'all_gather_into_tensor 32x1x64 float32', 'isend 1 float32 ->2', 'fence:plan'."""
    if op.op.startswith("fence:"):
        return op.op
    if op.op == "batch_isend_irecv":
        parts = ", ".join(f"{name} {_dims(shape)} {'->' if name.endswith('send') else '<-'}{peer}"
                          for (name, shape), peer in zip(op.shape, op.peer or (None,) * len(op.shape)))
        return f"batch_isend_irecv({parts}) {op.dtype}"
    text = " ".join(t for t in (op.op, _dims(op.shape), op.dtype) if t)
    if op.peer is not None:
        text += f" {'->' if op.op.endswith('send') else '<-'}{op.peer}"
    return text


def _dims(shape) -> str:
    return "x".join(str(d) for d in shape)


def fold_repeats(items: list[str], max_period: int = MAX_PERIOD) -> list[str]:
    """Fold consecutive repeats of a block: [a, b, a, b, c] -> ['(a, b) x2', 'c'] (greedy, longest cover)."""
    out, i = [], 0
    while i < len(items):
        best_period, best_count = 1, 1
        for period in range(1, min(max_period, (len(items) - i) // 2) + 1):
            block = items[i:i + period]
            count = 1
            while items[i + count * period:i + (count + 1) * period] == block:
                count += 1
            if count > 1 and period * count > best_period * best_count:
                best_period, best_count = period, count
        block = items[i:i + best_period]
        if best_count == 1:
            out.append(block[0])
        else:
            inner = ", ".join(fold_repeats(block, max_period))
            out.append(f"({inner}) x{best_count}" if best_period > 1 else f"{inner} x{best_count}")
        i += best_period * best_count
    return out


def render_phase(number: int, run: PhaseRun) -> list[str]:
    groups: dict[str, list[str]] = {}  # label -> op texts, groups in order of first use
    for op in run.ops:
        groups.setdefault(op.label, []).append(op_text(op))
    lines = [f"### {number}. `{run.phase}`", "", "| group | ops, in order |", "|---|---|"]
    lines += [f"| `{label}` | {', '.join(fold_repeats(texts))} |" for label, texts in groups.items()]
    return lines + [""]


def layout_line(window: tuple[SequenceOp, ...]) -> str:
    """Group sizes of the recording rank, e.g. 'world 8, tp 2, cp 4, dp 1, pp 1'."""
    sizes = {op.group: len(op.ranks) for op in window}
    return ", ".join(f"{name} {sizes[name]}" for name in ("world", "tp", "cp", "dp", "pp") if name in sizes)


def plan_line(sequence: RankSequence, window: tuple[SequenceOp, ...]) -> str:
    """What the plan fence of this rollout claimed: micro-batches per step and their tokens."""
    first, last = window[0].seq, window[-1].seq
    plans = (n.fields for n in sequence.notes if n.kind == "fence:actor_train/plan" and first <= n.after_seq <= last)
    plan = next(plans, None)
    if not plan:
        return ""
    keys = ("num_steps", "micro_batches_per_step", "micro_batch_tokens", "loss_token_totals")
    return "The plan fence of this rollout: " + ", ".join(f"{k} `{plan[k]}`" for k in keys if k in plan) + "."


def render(sequences: dict[int, RankSequence], *, rollout_index: int, rank: int) -> str:
    sequence = sequences[rank]
    windows = rollout_windows(sequence)
    if not 0 <= rollout_index < len(windows):
        raise ValueError(f"rank {rank} recorded {len(windows)} rollouts; rollout {rollout_index} is not among them")
    window = windows[rollout_index]
    runs = phase_runs(window)
    report = check_order(sequences)
    verdict = report.format().splitlines()[0].removeprefix("order proof: ")
    lines = [
        "# One rollout of the fenced step, as recorded",
        "",
        "Generated from the ledger of a real `python train.py` run (`make step-sequence`: "
        "`python -m slime.tools.record_step_sequence --doc docs/step_sequence.md`, rendered by "
        "`slime.tools.render_step_sequence`); do not edit by hand.",
        "",
        f"Rollout {rollout_index} (0-based) of {len(windows)}, from its wake to the sleep after the weight sync, "
        f"as rank {rank} recorded it: {len(window)} ops in {len(runs)} phase runs. "
        f"Group sizes: {layout_line(window)}.",
        plan_line(sequence, window),
        "",
        f"Order proof over all ranks and the whole run (`python -m slime.distributed.order_proof`): {verdict}.",
        "",
        "Notation: `op shape dtype`, shapes as `AxBxC`; `->N` / `<-N` is the peer of a send / receive; "
        "`(a, b) xN` is a block repeated N times in a row; `fence:<name>` is a fence's all-gather over the "
        "persistent gloo group; `wait` is the bounded wait of a warm-up op. Groups are named by megatron's "
        "parallel_state (`tp`, `cp`, `dp_cp`, `mp`, ...) and their global ranks.",
        "",
        "## Phase list",
        "",
        "| # | phase | ops | groups |",
        "|---|---|---|---|",
    ]
    for number, run in enumerate(runs, 1):
        groups = list(dict.fromkeys(op.group for op in run.ops))
        lines.append(f"| {number} | `{run.phase}` | {len(run.ops)} | {', '.join(groups)} |")
    lines += ["", "## Collectives per phase and group", ""]
    for number, run in enumerate(runs, 1):
        lines += render_phase(number, run)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ledger_dir", help="the --ledger-dir of a run made with --ledger-record-sequence")
    parser.add_argument("--out", default=None, help="write the page here (default: stdout)")
    parser.add_argument("--rollout", type=int, default=1, help="which rollout of the run (0-based; default 1)")
    parser.add_argument("--rank", type=int, default=0, help="whose recording to render (default 0)")
    args = parser.parse_args(argv)
    sequences = read_sequences(args.ledger_dir)
    if args.rank not in sequences:
        parser.error(f"no sequence_rank{args.rank}.jsonl in {args.ledger_dir!r}: run train.py with "
                     "--ledger-record-sequence --ledger-dir DIR")
    page = render(sequences, rollout_index=args.rollout, rank=args.rank)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(page)
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
