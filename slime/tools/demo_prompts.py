"""Write demo prompts as JSONL: arithmetic questions, or the counting task of the learnable demo.

    python -m slime.tools.demo_prompts --out FILE [--n 64] [--seed 0] [--task arithmetic|counting]

arithmetic: {"prompt": "What is 3 + 4? ...", "label": "7"}; `--rm-type math` grades the final
number of a response against the label.
counting: {"prompt": "345", "label": "678"}: a run of consecutive digits (modulo 10) and the digits
that continue it; examples/counting_reward.py grades a response digit by digit.
Use `--input-key prompt --label-key label`.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

_OPERATIONS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def make_prompts(n: int, seed: int = 0, max_operand: int = 20) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        symbol = rng.choice(sorted(_OPERATIONS))
        answer = _OPERATIONS[symbol](a, b)
        prompt = f"What is {a} {symbol} {b}? Put the final answer in \\boxed{{}}."
        rows.append({"prompt": prompt, "label": str(answer)})
    return rows


def make_counting_prompts(n: int, seed: int = 0, *, prompt_digits: int = 3,
                          answer_digits: int = 3) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start = rng.randint(0, 9)
        digits = "".join(str((start + i) % 10) for i in range(prompt_digits + answer_digits))
        rows.append({"prompt": digits[:prompt_digits], "label": digits[prompt_digits:]})
    return rows


TASKS = {"arithmetic": make_prompts, "counting": make_counting_prompts}


def write_prompts(out: str | Path, n: int, seed: int = 0, task: str = "arithmetic") -> Path:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in TASKS[task](n, seed):
            f.write(json.dumps(row) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", choices=sorted(TASKS), default="arithmetic")
    args = parser.parse_args(argv)
    path = write_prompts(args.out, args.n, args.seed, args.task)
    print(f"wrote {args.n} prompts to {path}")


if __name__ == "__main__":
    main()
