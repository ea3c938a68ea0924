"""Write the square-counting image task: small pictures with N squares of one colour among others.

    python -m slime.tools.square_images --out DIR [--n 64] [--seed 0] [--size 32] [--max-count 4]

Each picture (size x size pixels, grey background) holds N red squares (0 .. --max-count) and up to two squares
of other colours, none overlapping; the prompt is "<image>how many red squares?" and the label str(N). Writes
DIR/squares.parquet (an `images` column of image structs {"bytes": PNG, "path": None}, as HF datasets store
images) and DIR/squares.jsonl (the same rows, each image a base64 PNG string), both read with
`--input-key prompt --label-key label --multimodal-keys '{"image": "images"}' --apply-chat-template`;
examples/square_count_reward.py grades a response. The same seed writes the same bytes.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import random
from pathlib import Path

PROMPT = "<image>how many red squares?"
TARGET = (220, 30, 30)
DISTRACTORS = ((30, 60, 220), (30, 170, 60))
BACKGROUND = (128, 128, 128)


def _free_spots(size: int, side: int) -> list[tuple[int, int]]:
    """Top-left corners of a grid of non-overlapping cells, one square per cell."""
    cell = side + 2
    return [(x, y) for x in range(1, size - cell + 1, cell) for y in range(1, size - cell + 1, cell)]


def draw_picture(count: int, rng: random.Random, size: int = 32, side: int = 5) -> bytes:
    """PNG bytes of one picture with `count` target squares and 0-2 distractors."""
    from PIL import Image, ImageDraw

    spots = _free_spots(size, side)
    distractors = rng.randint(0, 2)
    if count + distractors > len(spots):
        raise ValueError(f"a {size}-pixel picture holds at most {len(spots)} squares of side {side}")
    chosen = rng.sample(spots, count + distractors)
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for index, (x, y) in enumerate(chosen):
        colour = TARGET if index < count else rng.choice(DISTRACTORS)
        draw.rectangle([x, y, x + side - 1, y + side - 1], fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def make_rows(n: int, seed: int = 0, size: int = 32, max_count: int = 4) -> list[dict]:
    """Rows {"prompt", "label", "images": [PNG bytes]}; counts spread evenly over 0 .. max_count."""
    rng = random.Random(seed)
    rows = []
    for index in range(n):
        count = index % (max_count + 1)
        rows.append({"prompt": PROMPT, "label": str(count), "images": [draw_picture(count, rng, size)]})
    rng.shuffle(rows)
    return rows


def write_task(out_dir: str | Path, n: int = 64, seed: int = 0, size: int = 32, max_count: int = 4) -> dict[str, Path]:
    """Writes squares.parquet and squares.jsonl under out_dir; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = make_rows(n, seed, size, max_count)
    table = pa.table({
        "prompt": [row["prompt"] for row in rows],
        "label": [row["label"] for row in rows],
        "images": [[{"bytes": image, "path": None} for image in row["images"]] for row in rows],
    })
    paths = {"parquet": out / "squares.parquet", "jsonl": out / "squares.jsonl"}
    pq.write_table(table, paths["parquet"])
    with paths["jsonl"].open("w") as handle:
        for row in rows:
            images = [base64.b64encode(image).decode("ascii") for image in row["images"]]
            handle.write(json.dumps({**row, "images": images}) + "\n")
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--max-count", type=int, default=4)
    ns = parser.parse_args(argv)
    paths = write_task(ns.out, ns.n, ns.seed, ns.size, ns.max_count)
    print(f"wrote {ns.n} pictures to {paths['parquet']} and {paths['jsonl']}")


if __name__ == "__main__":
    main()
